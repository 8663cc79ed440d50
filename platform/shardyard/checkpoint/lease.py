"""The run's lease: one launch trains a run directory at a time.

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

What a store must offer: an exclusive create (a second create of the same name fails). A launch
probes that once when it takes the lease (lease/probe-*) and refuses a store that let a second
create through (an S3-compatible store that ignores `If-None-Match`): two launches would both
hold the run. Each launch's lease has an id of its own, and the fence compares the holder's id
as well as its generation.

Which launch wrote which checkpoint: each lease record carries the run's generation ceilings
(generations.py), so that a commit a stale holder makes late never counts.

"Its holder's process no longer exists" is decided only where the holder's record names this
machine *and* this PID namespace: the host name, the kernel's boot id and the PID namespace
all equal ours. Containers with host networking share a host name, not their PIDs; there, and
on any other machine, only the TTL decides.
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
from dataclasses import dataclass, replace
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import psutil

from shardyard.checkpoint.generations import LEASE_DIR, Lineage, attempt_file, attempts, current_lease
from shardyard.checkpoint.record import newest_name, record_generations, step_of
from shardyard.storage.store import RunStorage
from shardyard.spec import SpecError

log = logging.getLogger("shardyard")

TTL_S = 30.0  # renewed every TTL_S / 3: a holder that stopped renewing is gone within TTL_S
KEEP_GENERATIONS = 3  # older lease files are removed by the holder (a few stay for the record)


class LeaseHeld(SpecError):
    """Another launch holds the run: refused before anything starts (the CLI exits 2)."""


class LeaseLost(RuntimeError):
    """This launch's lease was taken over (or could not be renewed): it stops, committing nothing."""


class LineageUnknown(SpecError):
    """The run's checkpoints name lease generations its lease files do not know (lease/ was
    cleared or not copied): taken over only when the user says so (the CLI exits 2)."""


class StoreCannotFence(SpecError):
    """The run's storage let a second exclusive create of one name through: no lease can hold."""


def _process_start(pid: int) -> float | None:
    """When process `pid` started, or None if there is none (a zombie counts as none)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.Error:
        return None


@cache
def _machine() -> dict[str, str]:
    """Where this process's PIDs mean something: the host name, the kernel's boot id (a reboot
    reuses PIDs) and the PID namespace (containers on one kernel each number their own)."""
    def read(path: str, how: Callable[[str], str]) -> str:
        try:
            return how(path)
        except OSError:
            return ""
    return {"host": socket.gethostname(),
            "boot_id": read("/proc/sys/kernel/random/boot_id", lambda p: Path(p).read_text().strip()),
            "pid_ns": read("/proc/self/ns/pid", os.readlink)}


def process_gone(record: dict[str, Any]) -> bool:
    """The holder's PID is one of ours (same host, boot and PID namespace) and its process is no
    longer there. A record lacking any of them (another machine, an older version) is not judged."""
    here = _machine()
    if not all(here[key] and record.get(key) == here[key] for key in here):
        return False
    return _process_start(record["pid"]) != record["started"]


def identity() -> dict[str, Any]:
    pid = os.getpid()
    return {**_machine(), "pid": pid, "started": _process_start(pid)}


def renewer(interval_s: float, renew: Callable[[], bool], name: str) -> tuple[threading.Thread, threading.Event]:
    """A daemon thread calling `renew` every `interval_s` until it returns False or is stopped
    (`renew` handles its own errors: one that escapes ends the renewals)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s) and renew():
            pass
    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread, stop


# ----------------------------------------------------------------------------- the run's lease


@dataclass(frozen=True)
class LeaseFence:
    """A check that raises LeaseLost once the run's lease is not held by launch `holder` at
    `generation` (both: a store that let two launches make one generation is caught too)."""

    run_uri: str
    generation: int
    holder: str
    base_step: int = -1  # the step this launch started from, written into its commit records
    attempt: int | None = None  # this worker group's, within the launch (None: the launch's driver)

    @cached_property
    def storage(self) -> RunStorage:
        return RunStorage(self.run_uri)

    def __call__(self) -> None:
        held = current_lease(self.storage)
        if held is None or (held["generation"], held.get("id")) != (self.generation, self.holder) \
                or held.get("released"):
            by = f"host {held['host']}, pid {held['pid']}, generation {held['generation']}" if held else "nobody"
            raise LeaseLost(f"run {self.run_uri}: this launch's lease (generation {self.generation}) is no longer "
                            f"held (now: {by}); it stops and commits nothing more")
        if self.attempt is not None:
            newest = max(attempts(self.storage).get(self.generation, {self.attempt: -1}))
            if newest != self.attempt:
                raise LeaseLost(f"run {self.run_uri}: worker group {newest} of this launch has started since this "
                                f"group ({self.attempt}) did; this group stops and commits nothing more")

    def for_new_group(self) -> LeaseFence:
        """This launch's fence for a worker group starting now: its attempt, one above every
        earlier group's, made exclusively with the step it starts from (the newest checkpoint)."""
        newest = newest_name(self.storage, check_files=False)
        base = step_of(newest) if newest else -1
        while True:
            attempt = max(attempts(self.storage).get(self.generation, {0: -1})) + 1
            record = json.dumps({"generation": self.generation, "attempt": attempt, "base_step": base}).encode()
            if self.storage.create_exclusive(record, LEASE_DIR, attempt_file(self.generation, attempt)):
                return replace(self, attempt=attempt)


# Object stores whose "create only if absent" is one atomic request (s3fs sends `If-None-Match: *`).
# fsspec's own default checks whether the name exists and then writes: two launches racing
# through it both succeed, and a probe made one create after the other cannot tell.
ATOMIC_CREATE = {"s3", "s3a"}


def probe_exclusive_create(storage: RunStorage) -> None:
    """Refuse a store whose exclusive create is not one atomic request, or lets a second create
    of one name through (an S3-compatible store that ignores If-None-Match)."""
    protocols = storage.fs.protocol if isinstance(storage.fs.protocol, tuple) else (storage.fs.protocol,)
    if storage.remote and not ATOMIC_CREATE & set(protocols):
        raise StoreCannotFence(
            f"the run's storage {storage.url()} has no atomic create-if-absent that shardyard knows (its "
            f"filesystem checks, then writes: two launches could both hold the run). Use a local or shared file "
            f"system, or an S3-compatible store with conditional writes (s3://)")
    name = f"probe-{uuid.uuid4().hex}"
    try:
        first = storage.create_exclusive(b"{}", LEASE_DIR, name)
        second = storage.create_exclusive(b"{}", LEASE_DIR, name)
    finally:
        storage.delete(LEASE_DIR, name)
    if not first or second:
        raise StoreCannotFence(
            f"the run's storage {storage.url()} does not refuse a second create of the same name (an S3-compatible "
            f"store that ignores If-None-Match?): two launches could both hold the run. Use a store with "
            f"conditional writes (AWS S3, GCS, MinIO, a local or shared file system)")


class RunLease:
    def __init__(self, run_uri: str, run_name: str, ttl_s: float = TTL_S) -> None:
        self.storage = RunStorage(run_uri)
        self.run_name, self.ttl_s = run_name, ttl_s
        self.id = uuid.uuid4().hex
        self.generation = 0
        self.base_step = -1
        self.ceilings: dict[str, int] = {}
        self._made = False  # whether this launch made its generation's lease file
        self.lost = threading.Event()
        self._beat = 0
        self._renewing: tuple[threading.Thread, threading.Event] | None = None
        self._last_renewed = time.monotonic()

    def _record(self, released: bool = False) -> bytes:
        return json.dumps({"generation": self.generation, "id": self.id, "beat": self._beat, "ttl_s": self.ttl_s,
                           "released": released, "base_step": self.base_step, "ceilings": self.ceilings,
                           **identity()}).encode()

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
        probe_exclusive_create(self.storage)
        leased = held["generation"] if held else 0
        younger = sorted({g for g in record_generations(self.storage) if g > leased})
        if younger and not take_over:
            raise LineageUnknown(
                f"run '{self.run_name}': its checkpoints name lease generation {younger[-1]}, but its lease files "
                f"in {self.storage.url(LEASE_DIR)} go up to {leased} only (the folder was cleared, or not copied "
                f"with the checkpoints): nothing was deleted. If no other launch trains this run, launch with "
                f"--take-over to continue from its newest checkpoint")
        if younger:
            log.warning("run '%s': taking it over past lease generation %d, which only its checkpoints name",
                        self.run_name, younger[-1])
        self.generation = max([leased, *younger]) + 1
        # The newest checkpoint now is where this launch's history starts: one of an earlier
        # launch committed after this moment is a stale writer's (generations.py).
        newest = newest_name(self.storage, check_files=False)
        self.base_step = step_of(newest) if newest else -1
        self.ceilings = Lineage(held).after_taking(self.generation, self.base_step, also=younger)
        self._made = self.storage.create_exclusive(self._record(), LEASE_DIR, self._file())
        if not self._made or (current_lease(self.storage) or {}).get("id") != self.id:
            raise LeaseHeld(f"run '{self.run_name}' was taken by another launch at the same moment "
                            f"(lease generation {self.generation}); this launch starts nothing")
        for name in self.storage.list(LEASE_DIR):  # a generation's lease file and its groups' attempts
            generation = name.partition(".")[0]
            if generation.isdigit() and int(generation) <= self.generation - KEEP_GENERATIONS:
                self.storage.delete(LEASE_DIR, name)
        self._last_renewed = time.monotonic()
        self._renewing = renewer(self.ttl_s / 3, self._renew, f"renew-lease-{self.run_name}")

    def fence(self) -> LeaseFence:
        return LeaseFence(self.storage.uri, self.generation, self.id, self.base_step)

    def check(self) -> None:
        self.fence()()

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
        """Give the run back (if this launch made its lease file: a launch refused never touches
        another's lease)."""
        if self._renewing is not None:
            thread, stop = self._renewing
            stop.set()
            # Bounded: a signal handler that raised inside a logging call (Ray's SIGTERM handler
            # does) leaves logging's lock held by this thread, and the renewer waits on it forever.
            thread.join(timeout=5)
        if not self._made:
            return
        if not self.lost.is_set():
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
        try:  # acquire inside: a SIGTERM raised in it right after the file was made releases it too
            self.acquire(take_over)
            yield self
        finally:
            self.release()
