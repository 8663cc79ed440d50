"""SIGTERM before training begins (spec checks, taking the lease, the preflight, Ray's start):
the launch stops cleanly at the next safe point, releasing what it took, with
shardyard/exit_codes.PREEMPTED; once training runs, the launcher's preemption notice handles
SIGTERM instead. The handler only records the signal (raising inside whatever code it lands in,
Ray's start among them, could leave that code half done). No Ray here: the CLI installs this
before it imports Ray."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_TERMINATED = threading.Event()


class StoppedBeforeTraining(BaseException):
    """SIGTERM arrived before training began: nothing to save. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on its way out swallows it."""


def _record(signum: int, frame: Any) -> None:
    _TERMINATED.set()


def terminated() -> bool:
    """Whether a SIGTERM arrived since the launch began (for the handler that takes over from
    this one: a signal that landed between the last safe point and its install is not lost)."""
    return _TERMINATED.is_set()


def stop_if_terminated() -> None:
    """A safe point: raise StoppedBeforeTraining if SIGTERM arrived since the launch began."""
    if _TERMINATED.is_set():
        raise StoppedBeforeTraining()


@contextmanager
def sigterm_before_training() -> Iterator[None]:
    """While the block runs, SIGTERM is recorded for `stop_if_terminated` (until the launcher's
    preemption notice takes SIGTERM over)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _TERMINATED.clear()
    previous = signal.signal(signal.SIGTERM, _record)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        # Heard during this launch, and answered by it: a later launch from the same process (a
        # notebook, a script that trains twice) starts without it.
        _TERMINATED.clear()


@contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """Ray's driver start installs a SIGTERM handler of its own that exits at once (code 15): the
    one there before it (this module's, under the CLI) is put back after it, and a SIGTERM that
    Ray's handler caught meanwhile stops the launch as ours would have."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    except SystemExit as err:
        if before is _record and err.code == signal.SIGTERM:
            raise StoppedBeforeTraining() from None
        raise
    finally:
        if before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, before)
    stop_if_terminated()
