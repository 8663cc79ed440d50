"""What attaches to the Trainer without being part of the loop: the run's event log, the sample
ledger, and fault injection for recovery drills and tests."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardyard.checkpoint.record import newest_name
from shardyard.data.ledger import SampleLedger
from shardyard.spec import SpecError
from shardyard.checkpoint.record import checkpoint_name
from shardyard.storage.store import RunStorage
from shardyard.storage.events import Event, log_event, read_events
from shardyard.train.trainer import Callback, Trainer


class RunEvents(Callback):
    """Rank 0 logs each worker-group start (fresh, resumed, or restarted after a failure); under
    hot recovery every other replica logs its own start too, and so does a replacement of any
    rank, rank 0's included (the group did not restart: from then on the quorum waits for it),
    and each replica the steps at which it healed from a peer."""

    def on_train_start(self, trainer: Trainer) -> None:
        hot = trainer.spec.scaling.recovery == "hot"
        events = read_events(trainer.spec.run_uri) if trainer.rank == 0 else []  # rank 0 logs the start
        if trainer.rank != 0 or (hot and replaces_lost_replicas(events, trainer.world_size)):
            if hot:
                log_event(trainer.spec.run_uri, Event.REPLICA_START, rank=trainer.rank, step=trainer.state.step)
            return
        spec, restored, par = trainer.spec, trainer.restored, trainer.spec.parallelism
        log_event(spec.run_uri, Event.START, restored_step=trainer.state.step,
                  old_world_size=restored.world_size if restored else None, world_size=trainer.world_size,
                  restore_s=trainer.restore_s, global_batch=trainer.global_batch,
                  mesh={"pp": par.pp, "dp": par.dp_size(trainer.world_size), "tp": par.tp},
                  downtime_s=_since_failure(events))
        if trainer.global_batch != trainer.written.batch.global_batch_size:
            print(f"shardyard: world size {trainer.world_size} cannot keep batch.global_batch_size "
                  f"{trainer.written.batch.global_batch_size}; training with {trainer.global_batch} "
                  f"(batch.allow_global_batch_change)", flush=True)

    def on_healed(self, trainer: Trainer, from_step: int) -> None:
        log_event(trainer.spec.run_uri, Event.HEALED, rank=trainer.rank, from_step=from_step, to_step=trainer.state.step)


def replaces_lost_replicas(events: list[dict], world_size: int) -> bool:
    """Under hot recovery, whether a worker starting now replaces replicas lost while their peers
    trained on: this launch's group has started, and the newest failure since then lost some
    ranks, not all (Ray Train then starts replacements for those alone; losing all restarts the
    group)."""
    launched = max((i for i, e in enumerate(events) if e["event"] == Event.LAUNCH), default=-1)
    last_start, failures = _failures_since_last_start(events)
    return last_start > launched and bool(failures) and len(failures[-1]["ranks"]) < world_size


def _since_failure(events: list[dict]) -> float | None:
    """Seconds from the failure that caused this worker-group start to now (None if none did)."""
    _, failures = _failures_since_last_start(events)
    return time.time() - failures[0]["time"] if failures else None


def _failures_since_last_start(events: list[dict]) -> tuple[int, list[dict]]:
    """The index of the newest worker-group start (-1 if none) and the failures logged after it."""
    last_start = max((i for i, e in enumerate(events) if e["event"] == Event.START), default=-1)
    return last_start, [e for e in events[last_start + 1:] if e["event"] == Event.FAILURE]


class LedgerCallback(Callback):
    """Records each step's sample ids per data-owning rank (`run.sample_ledger`): the ids before
    the step's gradients leave the rank, a commit line once it is applied. `attempt` names this
    worker group (the same on every rank); `writer` this worker (its rank, in a fixed group)."""

    def __init__(self, run_uri: str, writer: str, attempt: float) -> None:
        self.ledger = SampleLedger(run_uri, writer, attempt)

    def on_step_start(self, trainer: Trainer, ids: list[torch.Tensor]) -> None:
        if trainer.engine.data_owner:
            self.ledger.training(trainer.state.step + 1, trainer.engine.dp_size, ids, trainer.engine.step_round,
                                 trainer.engine.dp_rank)

    def on_step_end(self, trainer: Trainer) -> None:
        if trainer.engine.data_owner:
            self.ledger.committed(trainer.state.step, trainer.engine.step_round)


def group_attempt() -> float:
    """Collective: one id for this worker group, rank 0's start time, on every rank."""
    attempt = [time.time()]
    dist.broadcast_object_list(attempt, src=0)
    return attempt[0]


CRASH_ENV = "SHARDYARD_INJECT_CRASH"
HOLD_ENV = "SHARDYARD_HOLD_AT"


def injected_crash_step() -> int | None:
    """`SHARDYARD_INJECT_CRASH=checkpoint:STEP`: the last rank dies (SIGKILL) once, as the
    checkpoint of STEP is being written (after rank 0 has started it, before its own shard)."""
    value = os.environ.get(CRASH_ENV)
    if not value:
        return None
    where, _, step = value.partition(":")
    if where != "checkpoint" or not step.isdigit():
        raise SpecError(f"{CRASH_ENV}={value!r}: expected checkpoint:STEP, e.g. checkpoint:100")
    return int(step)


def hold_steps() -> list[int]:
    """`SHARDYARD_HOLD_AT=STEP[,STEP...]`: steps after which the run waits (see HoldAtSteps)."""
    value = os.environ.get(HOLD_ENV, "")
    steps = [part.strip() for part in value.split(",") if part.strip()]
    if not all(s.isdigit() for s in steps):
        raise SpecError(f"{HOLD_ENV}={value!r}: expected steps, e.g. 100,200")
    return [int(s) for s in steps]


class CrashAtCheckpoint(Callback):
    """Kills the last rank once while the checkpoint of `step` is being written: the other ranks
    have begun it, so the directory exists but never commits, and Ray Train restarts the group."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_checkpoint_start(self, trainer: Trainer) -> None:
        if trainer.state.step != self.step or trainer.rank != trainer.world_size - 1:
            return
        run = trainer.spec.run_uri
        if any(e["event"] == Event.INJECTED_CRASH and e["step"] == self.step for e in read_events(run)):
            return  # once: the restarted run must get past this step
        latest = newest_name(RunStorage(run))
        log_event(run, Event.INJECTED_CRASH, step=self.step, rank=trainer.rank, latest_complete=latest)
        time.sleep(1.0)  # rank 0 creates the directory and starts its write meanwhile
        os.kill(os.getpid(), signal.SIGKILL)


class HoldAtSteps(Callback):
    """For tests that act on a run mid-flight: after a listed step (once its checkpoint is written,
    at a checkpoint step; or once it healed past it) rank 0 logs a `held` event and waits until the
    file `<run>/release_<step>` exists (the other ranks wait for it in their next collective). A
    worker group that resumes from a checkpoint holds again at a listed step past it, unless that
    step was released."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_step_end(self, trainer: Trainer) -> None:
        if not trainer.checkpoint_scheduled(trainer.state.step):
            self._hold(trainer, checkpoint=None)

    def on_checkpoint_end(self, trainer: Trainer) -> None:
        if trainer.checkpoint_scheduled(trainer.state.step):  # else held at the step's end already
            self._hold(trainer, checkpoint=checkpoint_name(trainer.state.step))

    def on_healed(self, trainer: Trainer, from_step: int) -> None:
        # A replica that copied a live peer's state past a listed step (hot recovery: it joined
        # late) reached that step by healing instead of training: it holds there now.
        for step in sorted(s for s in self.steps if from_step < s <= trainer.state.step):
            self._hold(trainer, checkpoint=None, step=step)

    def _hold(self, trainer: Trainer, checkpoint: str | None, step: int | None = None) -> None:
        step = trainer.state.step if step is None else step
        if trainer.rank != 0 or step not in self.steps:
            return
        storage = RunStorage(trainer.spec.run_uri)
        # The holding process's id: drills act on it (kill rank 0 while it holds).
        log_event(storage.uri, Event.HELD, step=step, world_size=trainer.world_size, checkpoint=checkpoint,
                  pid=os.getpid())
        while not storage.exists(release_file(step)):
            time.sleep(0.1)


def release_file(step: int) -> str:
    return f"release_{step}"


def held_at(run: str | Path, step: int) -> dict | None:
    """The run's `held` event at `step` (SHARDYARD_HOLD_AT), once it is there."""
    return next((e for e in read_events(run) if e["event"] == Event.HELD and e["step"] == step), None)


def release(run: str | Path, *steps: int) -> None:
    """Lets a run held at these steps go on (and never hold there)."""
    storage = RunStorage(run)
    for step in steps:
        storage.write_bytes(b"", release_file(step))
