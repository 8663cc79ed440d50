"""A run's lease: one launch at a time trains a run directory.

Two launches with the same `run.name` and storage would each resume from, overwrite and prune
the other's checkpoints. The driver that launches a run writes `<run>/LEASE.json` (who holds it,
until when) and renews it while the run goes on; another launch is refused while the lease is
held, naming its holder. A lease whose holder is gone is taken over: one that has expired, or, on
the holder's own host, one whose process no longer exists (a driver killed by `ray job stop` or
Ctrl-C leaves its lease behind, and the resubmitted job must not wait for it). `take_over` takes
the lease whatever its state, for a holder the user knows is gone on another host.
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
from shardyard.train.checkpoint import RunStorage

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


class RunLease:
    def __init__(self, run_uri: str, run_name: str, ttl_s: float = TTL_S) -> None:
        self.storage, self.run_name, self.ttl_s = RunStorage(run_uri), run_name, ttl_s
        self.id = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def read(self) -> dict[str, Any] | None:
        if not self.storage.exists(LEASE_FILE):
            return None
        try:
            return json.loads(self.storage.read_bytes(LEASE_FILE))
        except (FileNotFoundError, json.JSONDecodeError):  # released, or being replaced, as it was read
            return None

    def _write(self) -> None:
        pid = os.getpid()
        record = {"id": self.id, "host": socket.gethostname(), "pid": pid, "started": _process_start(pid),
                  "expires": time.time() + self.ttl_s}
        self.storage.write_bytes(json.dumps(record).encode(), LEASE_FILE)

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
        self._write()
        self._renewer = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            held = self.read()
            if held is not None and held["id"] != self.id:
                log.error("run '%s' was taken over by host %s, pid %s: this launch no longer holds it",
                          self.run_name, held["host"], held["pid"])
                return
            self._write()

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        held = self.read()
        if held is not None and held["id"] == self.id:
            self.storage.delete(LEASE_FILE)
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
