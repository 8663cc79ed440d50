"""A preemption notice to a running launch: SIGTERM or Ctrl-C asks the workers to checkpoint at the
next step boundary and stop (`<run>/PREEMPT`), a second Ctrl-C stops the launch at once."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray

from shardyard import exit_codes
from shardyard.checkpoint.record import newest_step
from shardyard.spec import JobSpec
from shardyard.storage.store import RunStorage
from shardyard.train.early_sigterm import terminated
from shardyard.train.step_guard import PREEMPT_FILE


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C: the launch stops without waiting for a checkpoint (a KeyboardInterrupt,
    so that it leaves through every `except Exception`). Its message says what is lost."""


# The signals that ask a running launch to checkpoint at the next step boundary and stop, by the
# name the user knows them by.
NOTICES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


@dataclass
class Notice:
    """What a launch heard: the first notice's signal by name (NOTICES), None while none came."""
    by: str | None = None


@contextmanager
def preemption_notice(spec: JobSpec) -> Iterator[Notice]:
    """While the block runs, SIGTERM or a Ctrl-C asks the workers to checkpoint at the next step
    boundary and stop (`<run>/PREEMPT`); if the run has not ended `checkpoint.preempt_timeout_s`
    later, the driver exits anyway. A second Ctrl-C stops the launch at once (StoppedAtOnce).
    Installed after Ray's own driver handler, which would abort at once; Ray Train's own Ctrl-C
    handler (which aborts the workers wherever they are) is never installed: `fit_in_background`.
    Yields the Notice, filled in once one is heard."""
    storage = RunStorage(spec.run_uri)
    storage.delete(PREEMPT_FILE)  # a notice a stopped launch left behind is not for this one
    heard = Notice()
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield heard
        return
    # The handler only queues the notice (SimpleQueue.put is reentrant): printing or starting a
    # thread inside it could deadlock or raise when a second signal lands while the first is handled.
    notices: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    ended = threading.Event()
    interrupts = [0]

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            interrupts[0] += 1
            if interrupts[0] > 1:
                raise StoppedAtOnce()
        notices.put(NOTICES[signum])

    def act_on_notice() -> None:
        by = notices.get()
        if by is None:
            return
        heard.by = by
        timeout = spec.checkpoint.preempt_timeout_s
        deadline = time.monotonic() + timeout
        again = "; Ctrl-C again stops at once, losing the steps since the last checkpoint" if by == "Ctrl-C" else ""
        print(f"shardyard: {by}: checkpointing run '{spec.run.name}' at the next step boundary, then "
              f"stopping (at most {timeout:g} s{again})", file=sys.stderr, flush=True)
        while time.monotonic() < deadline:  # storage that fails now may answer in a moment
            try:
                storage.write_bytes(str(time.time()).encode(), PREEMPT_FILE)
                break
            except OSError as err:
                print(f"shardyard: cannot write the preemption notice {storage.url(PREEMPT_FILE)} ({err}); "
                      f"retrying", file=sys.stderr, flush=True)
                if ended.wait(1.0):
                    return
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            print(f"shardyard: no checkpoint committed within checkpoint.preempt_timeout_s ({timeout:g} s); "
                  f"stopping: a new launch resumes from the last committed one", file=sys.stderr, flush=True)
            os._exit(exit_codes.PREEMPT_TIMED_OUT)

    watcher = threading.Thread(target=act_on_notice, name="shardyard-preemption-notice", daemon=True)
    watcher.start()
    previous = {signum: signal.signal(signum, on_signal) for signum in NOTICES}
    if terminated():  # heard by the handler before this one, after the launch's last look at it
        notices.put("SIGTERM")
    try:
        yield heard
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        ended.set()
        notices.put(None)
        watcher.join()
        storage.delete(PREEMPT_FILE)


def stopped_at_once(spec: JobSpec) -> str:
    """After a second Ctrl-C: Ray is shut down (a local instance and this driver's workers with
    it), then what a new launch resumes from, and so what is lost."""
    ray.shutdown()
    step = newest_step(RunStorage(spec.run_uri))
    resumes = f"from step {step}, its last committed checkpoint" if step else "from the start"
    return (f"second Ctrl-C: run '{spec.run.name}' stopped at once; a new launch resumes {resumes}, and the steps "
            f"trained after it are lost")
