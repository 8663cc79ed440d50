"""Who is using a run's storage: the run's lease (one launch trains a run directory at a time)
and reader holds on its checkpoints (a checkpoint being read is not pruned).

Two launches with the same `run.name` and storage would each resume from, overwrite and prune
the other's checkpoints. The driver that launches a run writes `<run>/LEASE.json` (who holds it,
until when) and renews it while the run goes on; another launch is refused while the lease is
held, naming its holder. A lease whose holder is gone is taken over: one that has expired, or, on
the holder's own host, one whose process no longer exists (a driver killed by `ray job stop` or
Ctrl-C leaves its lease behind, and the resubmitted job must not wait for it). `take_over` takes
the lease whatever its state, for a holder the user knows is gone on another host.

Training keeps its newest `checkpoint.keep` checkpoints and deletes older ones as it commits new
ones. A reader of an older one would lose it mid-read: a replacement rank loading the checkpoint
it found while rank 0 commits the next (hot recovery), a serving shard group loading or serving
it. A reader holds the checkpoint while it reads (`<checkpoint>/holds/<id>.json`, renewed like the
lease); pruning skips a checkpoint with a live hold and deletes it at a later commit, once released.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psutil

from shardyard.spec import SpecError
from shardyard.train.storage import RunStorage

log = logging.getLogger("shardyard")

LEASE_FILE = "LEASE.json"
TTL_S = 30.0  # renewed every TTL_S / 3: a holder that stopped renewing is gone within TTL_S


class LeaseHeld(SpecError):
    """Another launch holds the run: refused before anything starts (the CLI exits 2)."""


def _process_start(pid: int) -> float | None:
    """When process `pid` started, or None if there is none (a zombie counts as none)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.Error:
        return None


def holder_alive(lease: dict[str, Any], now: float) -> bool:
    if now > lease["expires"]:
        return False
    if lease["host"] == socket.gethostname():  # its process can be asked directly
        return _process_start(lease["pid"]) == lease["started"]
    return True


class HeldFile:
    """A record at `parts` of `storage` saying that this process uses something (its host, pid and
    process start time, and until when), renewed every `ttl_s / 3` by a thread until released.
    Others read it with `holder_alive`."""

    def __init__(self, storage: RunStorage, parts: tuple[str, ...], ttl_s: float) -> None:
        self.storage, self.parts, self.ttl_s = storage, parts, ttl_s
        self.id = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def read(self) -> dict[str, Any] | None:
        if not self.storage.exists(*self.parts):
            return None
        try:
            return json.loads(self.storage.read_bytes(*self.parts))
        except (FileNotFoundError, json.JSONDecodeError):  # released, or being replaced, as it was read
            return None

    def _write(self) -> None:
        pid = os.getpid()
        record = {"id": self.id, "host": socket.gethostname(), "pid": pid, "started": _process_start(pid),
                  "expires": time.time() + self.ttl_s}
        self.storage.write_bytes(json.dumps(record).encode(), *self.parts)

    def start(self) -> None:
        self._write()
        self._renewer = threading.Thread(target=self._renew, name=f"renew-{self.parts[-1]}", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            held = self.read()
            if held is not None and held["id"] != self.id:
                self.taken_over(held)
                return
            self._write()

    def taken_over(self, by: dict[str, Any]) -> None:
        log.error("%s was taken over by host %s, pid %s", self.storage.url(*self.parts), by["host"], by["pid"])

    def stop(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        held = self.read()
        if held is not None and held["id"] == self.id:
            self.storage.delete(*self.parts)


class RunLease(HeldFile):
    def __init__(self, run_uri: str, run_name: str, ttl_s: float = TTL_S) -> None:
        super().__init__(RunStorage(run_uri), (LEASE_FILE,), ttl_s)
        self.run_name = run_name

    def acquire(self, take_over: bool = False) -> None:
        held = self.read()
        if held is not None and not take_over and holder_alive(held, time.time()):
            until = datetime.fromtimestamp(held["expires"]).isoformat(timespec="seconds")
            raise LeaseHeld(
                f"run '{self.run_name}' is being trained by another launch (host {held['host']}, pid {held['pid']}; "
                f"its lease in {self.storage.url(LEASE_FILE)} is renewed while it runs, valid until {until}). "
                f"Wait for it to end, use another run.name, or, if that launch is gone, launch with --take-over")
        if held is not None:
            log.warning("taking over run '%s' from a launch that is gone (host %s, pid %s)",
                        self.run_name, held["host"], held["pid"])
        self.start()

    def taken_over(self, by: dict[str, Any]) -> None:
        log.error("run '%s' was taken over by host %s, pid %s: this launch no longer holds it",
                  self.run_name, by["host"], by["pid"])

    def release(self) -> None:
        self.stop()
        root = self.storage.path()
        if self.storage.fs.isdir(root) and not self.storage.fs.ls(root):
            self.storage.fs.rmdir(root)  # a launch refused at its checks leaves no empty run directory

    @contextmanager
    def held(self, take_over: bool = False) -> Iterator[RunLease]:
        self.acquire(take_over)
        try:
            yield self
        finally:
            self.release()


HOLDS_DIR = "holds"
HOLD_TTL_S = 60.0


class CheckpointHold(HeldFile):
    def __init__(self, run_uri: str, name: str) -> None:
        storage = RunStorage(run_uri)
        super().__init__(storage, (name, HOLDS_DIR, f"{uuid.uuid4().hex}.json"), HOLD_TTL_S)


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


def live_holds(storage: RunStorage, name: str) -> list[dict[str, Any]]:
    """The holds on checkpoint `name` whose holders are still there."""
    if not storage.exists(name, HOLDS_DIR):
        return []
    now, live = time.time(), []
    for path in storage.fs.ls(storage.path(name, HOLDS_DIR), detail=False):
        try:
            record = json.loads(storage.fs.cat_file(path))
        except (FileNotFoundError, json.JSONDecodeError):  # released (or being renewed) as it was read
            continue
        if holder_alive(record, now):
            live.append(record)
    return live
