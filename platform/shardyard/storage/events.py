"""The run's append-only logs in its storage: JSON lines safe with several writers and with
writers that die mid-line, and the run's event log built on them.

Every writer appends whole lines to a file of its own (on object storage, which cannot append, it
rewrites that file of its own whole), and readers merge the files and skip a line that a killed
writer left cut off.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from shardyard.storage.store import RunStorage

EVENTS_DIR = "events"


# ----------------------------------------------------------------------------- JSON lines


def parse_lines(data: bytes, where: str) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a last line that a killed writer cut off is skipped."""
    lines = [line for line in data.decode(errors="replace").splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1 or data.endswith(b"\n"):
                raise ValueError(f"{where}: line {i + 1} is not JSON: {line[:200]!r}") from None
    return rows


_TAILS_ENDED: set[Path] = set()  # files this process has appended to
_TAILS_LOCK = threading.Lock()


def end_cut_off_tail(path: Path) -> None:
    """Drop the cut-off last line a killed writer left in its file, before its successor (a
    restarted rank 0, the same rank of the next attempt) appends: appended after it, the cut-off
    line would be in the middle, which readers must treat as damage."""
    if not path.is_file():
        return
    with path.open("rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class JsonLines:
    """One writer's JSON-lines file in the run's storage: whole lines appended locally; on object
    storage the writer's own rows rewritten whole (no other writer shares the file)."""

    def __init__(self, storage: RunStorage, *parts: str) -> None:
        self.storage, self.parts = storage, parts
        self._rows: list[dict[str, Any]] | None = None  # object storage: what this writer wrote

    def read(self) -> list[dict[str, Any]]:
        if not self.storage.exists(*self.parts):
            return []
        return parse_lines(self.storage.read_bytes(*self.parts), self.storage.url(*self.parts))

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row) + "\n"
        if not self.storage.remote:
            path = Path(self.storage.path(*self.parts))
            path.parent.mkdir(parents=True, exist_ok=True)
            with _TAILS_LOCK:  # before this process's first line: no line of its own is being written
                if path not in _TAILS_ENDED:
                    end_cut_off_tail(path)
                    _TAILS_ENDED.add(path)
            with path.open("a") as f:  # one write of a whole line
                f.write(line)
            return
        if self._rows is None:
            self._rows = self.read()
        self._rows.append(row)
        self.storage.fs.pipe_file(self.storage.path(*self.parts),
                                  "".join(json.dumps(r) + "\n" for r in self._rows).encode())


# ----------------------------------------------------------------------------- events

class Event(StrEnum):
    """Every kind of event a run's log holds. They are also how parts of shardyard that share no
    process tell each other what happened (a launch's driver reads how its workers stopped, the
    pool reads how large the run trains), so each is named here once."""
    # A launch (train/launcher.py): begun, its spec changed from the checkpoint it resumes, ended.
    LAUNCH = "launch"
    SPEC_CHANGED = "spec_changed"
    GAVE_UP = "gave_up"  # a repeated error: retrying would not help
    DIVERGED = "diverged"
    LEASE_LOST = "lease_lost"  # another launch took the run
    PREEMPTED = "preempted"  # stopped on a notice after committing `step`
    # A worker group (train/callbacks.py, train/startup.py, train/trainer.py).
    START = "start"
    FIRST_STEP = "first_step"
    FAILURE = "failure"
    REPLICA_START = "replica_start"  # hot recovery: a replica joined its peers
    HEALED = "healed"  # hot recovery: a replica caught up from a peer
    GROUP_CHANGE = "group_change"  # an in-place group's driver published a change: who leaves, who joins
    REGROUPED = "regrouped"  # an elastic group changed at a step boundary: members, world size
    INJECTED_CRASH = "injected_crash"
    HELD = "held"  # a hold point reached (run.hold_at_steps)
    SKIPPED_NONFINITE = "skipped_nonfinite"
    DRAIN_CHECKPOINT = "drain_checkpoint"  # a checkpoint written because a node is draining
    # Parameter servers (train/parameter_server/).
    WORKER_JOINED = "worker_joined"
    SERVER_RESTORED = "server_restored"
    # The pool (pool/arbiter.py): its decisions, and when each took effect.
    LEND = "lend"
    RETURN = "return"
    LEND_SERVING = "lend_serving"
    RETURN_TRAINING = "return_training"


# A launch's end that means it stopped for good, not to be retried as it stands.
STOPPED = (Event.GAVE_UP, Event.DIVERGED, Event.LEASE_LOST)

_WRITER = f"{socket.gethostname()}-{os.getpid()}"


def log_event(run_dir: str | Path, event: Event, **fields: Any) -> None:
    """Append one event to the run's event log. Each process writes a file of its own under
    `events/`.

    Events are ordered by cause, not by clocks: each carries `order`, one more than the highest
    of the events its writer can read (a Lamport clock). A worker group's `start` reads the
    `failure` that restarted it, so it comes after it even from a host whose clock is behind;
    `time` (the writer's clock) only breaks ties and is shown to people."""
    event = Event(event)  # an unknown kind fails here, in its writer, not later in a reader
    order = 1 + max((e.get("order", 0) for e in read_events(run_dir)), default=0)
    JsonLines(RunStorage(run_dir), EVENTS_DIR, f"{_WRITER}.jsonl").append(
        {"event": event.value, "order": order, "time": time.time(), **fields})


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every writer's events, in causal order (`order`, then time)."""
    storage = RunStorage(run_dir)
    if not storage.exists(EVENTS_DIR):
        return []
    files = [p.rsplit("/", 1)[-1] for p in storage.fs.ls(storage.path(EVENTS_DIR), detail=False)]
    rows = [row for name in files if name.endswith(".jsonl") for row in JsonLines(storage, EVENTS_DIR, name).read()]
    return sorted(rows, key=lambda e: (e.get("order", 0), e["time"]))


@dataclass(frozen=True)
class LaunchEnd:
    """How one launch ended, as its events say."""
    first_step: dict[str, Any] | None  # its first training step, with how long start-up took
    stopped: dict[str, Any] | None  # the event that stopped it for good (STOPPED), with its reason
    preempted_at: int | None  # the step it committed and stopped at on a notice


def launch_end(events: list[dict[str, Any]], launch_id: str) -> LaunchEnd:
    """How launch `launch_id` ended: the one reading of the event log that the driver's exit code
    comes from."""
    ended = {e["event"]: e for e in events if e.get("launch") == launch_id}
    stopped = next((ended[kind] for kind in STOPPED if kind in ended), None)
    preempted = ended.get(Event.PREEMPTED)
    return LaunchEnd(ended.get(Event.FIRST_STEP), stopped, None if preempted is None else preempted["step"])


METRICS_FILE = "metrics.jsonl"  # rank 0's row per logged step (train/metrics.py writes it)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metrics rows, one per logged step: a row logged again after a restart (the step
    recomputed from a checkpoint) replaces the earlier one; `resumed_at` markers drop rows past
    the checkpoint a restart resumed from."""
    rows: dict[int, dict[str, Any]] = {}
    for row in JsonLines(RunStorage(run_dir), METRICS_FILE).read():
        if "resumed_at" in row:
            rows = {step: r for step, r in rows.items() if step <= row["resumed_at"]}
        else:
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def validation_loss_at(rows: list[dict[str, Any]], step: int) -> float | None:
    """The validation loss the run logged last at or before `step` (None: none yet)."""
    logged = [r["val_loss"] for r in rows if "val_loss" in r and r["step"] <= step]
    return logged[-1] if logged else None
