"""Who is using a run's storage: the run's lease (one launch trains a run directory at a time)
and reader holds on its checkpoints (a checkpoint being read is not pruned).

The lease is a sequence of generations, `<run>/lease/<generation:08d>.json`, each file made
atomically only if absent (store.py: a hard link locally, a conditional PUT on object storage):
of two launches that try to take generation N + 1 at once exactly one makes the file, and the
other is refused. The highest generation is the holder. Its launch renews the file (a counter,
`beat`) every `ttl_s / 3`, and its workers check, before every commit and prune and at step
boundaries, that the highest generation is still theirs (`fence`): a launch whose lease was taken
over stops within one renewal period and commits nothing more.

A lease is gone when its holder's process no longer exists (on the holder's own host: a driver
killed by `ray job stop` or Ctrl-C; the resubmitted job must not wait), or when its record has
not changed for `ttl_s` as the *reader* watches it: expiry never compares two hosts' clocks.
A renewer that cannot write for `ttl_s` counts its lease as lost. `take_over` takes the lease
whatever its state, for a holder the user knows is gone.

Training keeps its newest `checkpoint.keep` checkpoints and deletes older ones as it commits new
ones. A reader of an older one would lose it mid-read: a replacement rank loading the checkpoint
it found while rank 0 commits the next (hot recovery), a serving shard group loading or serving
it. A reader holds the checkpoint while it reads (`<checkpoint>/holds/<id>.json`, renewed), and
pruning skips a checkpoint with a live hold and deletes it at a later commit, once released.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil

from shardyard.checkpoint.store import RunStorage
from shardyard.spec import SpecError

log = logging.getLogger("shardyard")

LEASE_DIR = "lease"
TTL_S = 30.0  # renewed every TTL_S / 3: a holder that stopped renewing is gone within TTL_S
KEEP_GENERATIONS = 3  # older lease files are removed by the holder (a few stay for the record)


class LeaseHeld(SpecError):
    """Another launch holds the run: refused before anything starts (the CLI exits 2)."""


class LeaseLost(RuntimeError):
    """This launch's lease was taken over (or could not be renewed): it stops, committing nothing."""


def _process_start(pid: int) -> float | None:
    """When process `pid` started, or None if there is none (a zombie counts as none)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.Error:
        return None


def process_gone(record: dict[str, Any]) -> bool:
    """The holder ran on this host and its process is no longer there."""
    return record["host"] == socket.gethostname() and _process_start(record["pid"]) != record["started"]


def _identity() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _process_start(pid)}


def _read_json(storage: RunStorage, *parts: str) -> dict[str, Any] | None:
    try:
        return json.loads(storage.read_bytes(*parts))
    except (FileNotFoundError, json.JSONDecodeError):  # released, or being replaced, as it was read
        return None


def _renewer(interval_s: float, renew: Callable[[], bool], name: str) -> tuple[threading.Thread, threading.Event]:
    """A daemon thread calling `renew` every `interval_s` until it returns False or is stopped."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s) and renew():
            pass
    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread, stop


# ----------------------------------------------------------------------------- the run's lease


def current_lease(storage: RunStorage) -> dict[str, Any] | None:
    """The record of the highest lease generation, or None if the run was never leased."""
    names = [n for n in storage.list(LEASE_DIR) if n.endswith(".json") and n[:-5].isdigit()]
    for name in sorted(names, reverse=True):
        record = _read_json(storage, LEASE_DIR, name)
        if record is not None:
            return record
        # a file is made whole (linked or PUT at once): an unreadable one was removed meanwhile
    return None


def lease_fence(run_uri: str, generation: int) -> Callable[[], None]:
    """A check that raises LeaseLost once the run's lease is no longer at `generation`."""
    storage = RunStorage(run_uri)

    def check() -> None:
        held = current_lease(storage)
        if held is None or held["generation"] != generation or held.get("released"):
            by = f"host {held['host']}, pid {held['pid']}" if held else "nobody"
            raise LeaseLost(f"run {run_uri}: this launch's lease (generation {generation}) is no longer held "
                            f"(now: {by}); it stops and commits nothing more")
    return check


class RunLease:
    def __init__(self, run_uri: str, run_name: str, ttl_s: float = TTL_S) -> None:
        self.storage = RunStorage(run_uri)
        self.run_name, self.ttl_s = run_name, ttl_s
        self.id = uuid.uuid4().hex
        self.generation = 0
        self.lost = threading.Event()
        self._beat = 0
        self._renewing: tuple[threading.Thread, threading.Event] | None = None
        self._last_renewed = time.monotonic()

    def _record(self, released: bool = False) -> bytes:
        return json.dumps({"generation": self.generation, "id": self.id, "beat": self._beat, "ttl_s": self.ttl_s,
                           "released": released, **_identity()}).encode()

    def _file(self, generation: int | None = None) -> str:
        return f"{generation or self.generation:08d}.json"

    def _watch_until_gone(self, held: dict[str, Any]) -> bool:
        """Whether `held` is gone: its process is gone, or its record stays unchanged for its ttl
        by this process's own clock (a live holder renews it every ttl / 3)."""
        if held.get("released") or process_gone(held):
            return True
        ttl = float(held.get("ttl_s", self.ttl_s))
        print(f"shardyard: run '{self.run_name}' is leased to host {held['host']}, pid {held['pid']}; "
              f"watching up to {ttl:.0f} s for it to be renewed", flush=True)
        deadline = time.monotonic() + ttl
        while time.monotonic() < deadline:
            time.sleep(min(ttl / 20, 1.0))
            now = current_lease(self.storage)
            if now is None or now.get("released"):
                return True
            if now["generation"] != held["generation"] or now["beat"] != held["beat"] or process_gone(now):
                return process_gone(now)  # renewed, or taken by another launch meanwhile
        return True

    def acquire(self, take_over: bool = False) -> None:
        held = current_lease(self.storage)
        if held is not None and not take_over and not self._watch_until_gone(held):
            held = current_lease(self.storage) or held
            raise LeaseHeld(
                f"run '{self.run_name}' is being trained by another launch (host {held['host']}, pid {held['pid']}; "
                f"its lease in {self.storage.url(LEASE_DIR)} is renewed while it runs). Wait for it to end, "
                f"use another run.name, or, if that launch is gone, launch with --take-over")
        if held is not None and not held.get("released"):
            log.warning("taking over run '%s' from a launch that is gone (host %s, pid %s)",
                        self.run_name, held["host"], held["pid"])
        self.generation = (held["generation"] if held else 0) + 1
        if not self.storage.create_exclusive(self._record(), LEASE_DIR, self._file()) \
                or (current_lease(self.storage) or {}).get("id") != self.id:
            raise LeaseHeld(f"run '{self.run_name}' was taken by another launch at the same moment "
                            f"(lease generation {self.generation}); this launch starts nothing")
        for name in self.storage.list(LEASE_DIR):
            if name[:-5].isdigit() and int(name[:-5]) <= self.generation - KEEP_GENERATIONS:
                self.storage.delete(LEASE_DIR, name)
        self._last_renewed = time.monotonic()
        self._renewing = _renewer(self.ttl_s / 3, self._renew, f"renew-lease-{self.run_name}")

    def check(self) -> None:
        lease_fence(self.storage.uri, self.generation)()

    def _renew(self) -> bool:
        try:
            self.check()
            self._beat += 1
            self.storage.write_bytes(self._record(), LEASE_DIR, self._file())
            self._last_renewed = time.monotonic()
            return True
        except LeaseLost as err:
            self._lose(str(err))
            return False
        except OSError as err:  # storage unreachable: keep trying until the lease may have expired
            if time.monotonic() - self._last_renewed < self.ttl_s:
                log.warning("run '%s': cannot renew its lease (%s); retrying", self.run_name, err)
                return True
            self._lose(f"run '{self.run_name}': its lease could not be renewed for {self.ttl_s:.0f} s ({err})")
            return False

    def _lose(self, why: str) -> None:
        log.error("%s", why)  # the workers find out themselves, through their fence
        self.lost.set()

    def release(self) -> None:
        if self._renewing is not None:
            thread, stop = self._renewing
            stop.set()
            thread.join()
        if self.generation and not self.lost.is_set():
            try:
                self.check()
                self.storage.write_bytes(self._record(released=True), LEASE_DIR, self._file())
            except (LeaseLost, OSError):
                pass
        root = self.storage.path()
        if self.storage.fs.isdir(root) and self.storage.list() == [LEASE_DIR]:
            self.storage.delete()  # a launch refused at its checks leaves no run directory behind

    @contextmanager
    def held(self, take_over: bool = False) -> Iterator[RunLease]:
        self.acquire(take_over)
        try:
            yield self
        finally:
            self.release()


# ----------------------------------------------------------------------------- reader holds

HOLDS_DIR = "holds"
HOLD_TTL_S = 60.0


def holder_alive(record: dict[str, Any], now: float) -> bool:
    """A reader's hold is live while its own renewal deadline has not passed and, on this host,
    its process exists. (Holds only delay pruning: a wrong guess costs disk, not data.)"""
    return now <= record["expires"] and not process_gone(record)


class CheckpointHold:
    """`<checkpoint>/holds/<id>.json`: this process reads the checkpoint; renewed until released."""

    def __init__(self, run_uri: str, name: str) -> None:
        self.storage = RunStorage(run_uri)
        self.parts = (name, HOLDS_DIR, f"{uuid.uuid4().hex}.json")
        self._renewing: tuple[threading.Thread, threading.Event] | None = None

    def _write(self) -> bool:
        self.storage.write_bytes(json.dumps({**_identity(), "expires": time.time() + HOLD_TTL_S}).encode(),
                                 *self.parts)
        return True

    def start(self) -> None:
        self._write()
        self._renewing = _renewer(HOLD_TTL_S / 3, self._write, f"renew-{self.parts[-1]}")

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


def live_holds(storage: RunStorage, name: str) -> list[dict[str, Any]]:
    """The holds on checkpoint `name` whose holders are still there."""
    now, live = time.time(), []
    for file in storage.list(name, HOLDS_DIR):
        record = _read_json(storage, name, HOLDS_DIR, file)
        if record is not None and holder_alive(record, now):
            live.append(record)
    return live
