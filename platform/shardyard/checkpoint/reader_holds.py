"""Reader holds: a checkpoint being read is not pruned.

Training keeps its newest `checkpoint.keep` checkpoints and deletes older ones as it commits new
ones. A reader of an older one would lose it mid-read: a replacement rank loading the checkpoint
it found while rank 0 commits the next (hot recovery), a serving shard group loading or serving
it. A reader holds the checkpoint while it reads (`<checkpoint>/holds/<id>.json`, renewed every
HOLD_TTL_S / 3, an I/O error retried at the next renewal), and pruning skips a checkpoint with a
live hold and deletes it at a later commit, once released.

A hold is judged by the pruner's own clock, never the reader's: a hold is live until its record
has stayed unchanged for HOLD_TTL_S as the pruner has watched it (`HoldWatch`, monotonic), or
until its process is gone where the pruner can tell (lease.process_gone). A reader whose clock
is hours behind holds as well as any other. (Holds only delay pruning: a wrong guess costs disk,
not data.)
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardyard.checkpoint.generations import read_json
from shardyard.checkpoint.lease import identity, process_gone, renewer
from shardyard.storage.store import RunStorage

log = logging.getLogger("shardyard")

HOLDS_DIR = "holds"
HOLD_TTL_S = 60.0


class CheckpointHold:
    """`<checkpoint>/holds/<id>.json`: this process reads the checkpoint; renewed until released."""

    def __init__(self, run_uri: str, name: str) -> None:
        self.storage = RunStorage(run_uri)
        self.parts = (name, HOLDS_DIR, f"{uuid.uuid4().hex}.json")
        self._beat = 0
        self._renewing: tuple[threading.Thread, threading.Event] | None = None

    def _write(self) -> None:
        self._beat += 1  # a renewal changes the record: that is what a pruner watches
        self.storage.write_bytes(json.dumps({**identity(), "beat": self._beat}).encode(), *self.parts)

    def _renew(self) -> bool:
        try:
            self._write()
        except OSError as err:  # the storage hiccuped: try again at the next renewal
            log.warning("cannot renew the hold on %s (%s); retrying", self.storage.url(self.parts[0]), err)
        return True

    def start(self) -> None:
        self._write()
        self._renewing = renewer(HOLD_TTL_S / 3, self._renew, f"renew-{self.parts[-1]}")

    def stop(self) -> None:
        if self._renewing is not None:
            thread, stop = self._renewing
            stop.set()
            thread.join()
        self.storage.delete(*self.parts)


@contextmanager
def holding(run_uri: str, name: str) -> Iterator[CheckpointHold | None]:
    """Hold checkpoint `name` of the run at `run_uri` for the block. Storage this process may only
    read gets no hold (a warning): the read goes on unprotected rather than failing."""
    hold: CheckpointHold | None = CheckpointHold(run_uri, name)
    try:
        hold.start()
    except OSError as err:
        log.warning("cannot hold %s (%s): training may prune it while it is read", hold.storage.url(name), err)
        hold = None
    try:
        yield hold
    finally:
        if hold is not None:
            hold.stop()


class HoldWatch:
    """What a pruner has seen of each hold: its record, and when (this process's monotonic clock)
    the pruner first saw the record as it is now."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[dict[str, Any], float]] = {}

    def alive(self, where: str, record: dict[str, Any]) -> bool:
        now = time.monotonic()
        before = self._seen.get(where)
        if before is None or before[0] != record:
            self._seen[where] = (record, now)
            return not process_gone(record)
        return now - before[1] <= HOLD_TTL_S and not process_gone(record)


def live_holds(storage: RunStorage, name: str, watch: HoldWatch | None = None) -> list[dict[str, Any]]:
    """The holds on checkpoint `name` whose holders are still there, as `watch` has seen them
    (a pruner keeps one; without it, every hold whose process is not known gone counts)."""
    watch = watch or HoldWatch()
    live = []
    for file in storage.list(name, HOLDS_DIR):
        record = read_json(storage, name, HOLDS_DIR, file)
        if record is not None and watch.alive(storage.url(name, HOLDS_DIR, file), record):
            live.append(record)
    return live
