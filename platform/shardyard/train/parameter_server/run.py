"""The parameter-server run's driver: starts the actors, replaces dead workers, rolls back after a
server died, checkpoints each cut and logs metrics as the Trainer does."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.lease import LeaseLost
from shardyard.checkpoint.manager import CheckpointManager, Fence
from shardyard.checkpoint.record import newest_name
from shardyard.data.ledger import SampleLedger
from shardyard.optim import Schedule, decayed
from shardyard.parallel import Engine, single_process
from shardyard.spec import JobSpec
from shardyard.storage.events import Event, log_event
from shardyard.train.cadence import Cadence
from shardyard.train.metrics import RunResult, finish_run
from shardyard.train.parameter_server.actors import (
    SERVER_LOST,
    Coordinator,
    ParameterServer,
    PSWorker,
    initial_model,
    partition,
    worker_batch,
    worker_resources,
    worker_slots,
)
from shardyard.train.step_guard import Diverged, StepGuard


class ParameterServerRun:
    """The driver: starts the actors, replaces dead workers, rolls back after a server died,
    checkpoints each cut and logs metrics like the Trainer."""

    def __init__(self, spec: JobSpec, fence: Fence | None = None) -> None:
        self.spec = spec
        self.slots, self.global_batch = worker_slots(spec), spec.batch.global_batch_size
        # The whole model and a single-process optimizer over it hold what checkpoints save and
        # restore; the servers hold the live partitions.
        self.engine: Engine = single_process(spec, initial_model(spec), torch.device("cpu"))
        self.params = dict(self.engine.model.named_parameters())
        self.parts = partition({n: p.numel() for n, p in self.params.items()}, spec.parallelism.num_servers)
        self.checkpoints = CheckpointManager(spec.run_uri, spec.checkpoint.keep,
                                             load_optimizer=spec.checkpoint.load_optimizer, fence=fence, spec=spec)
        self.attempt = time.time()
        self.ledger = SampleLedger(spec.run_uri, "ps-driver", self.attempt) if spec.run.sample_ledger else None
        self.generation = 0
        self.state = TrainState(world_size=self.slots)
        self.running: dict[ray.ObjectRef, tuple[str, Any]] = {}
        self.next_worker, self.failures = 0, 0
        self.guard = StepGuard(spec.run_uri, 0, torch.device("cpu"), fence, spec.checkpoint.lease_ttl_s / 3)
        self.preempt_step: int | None = None  # SIGTERM: the step checkpointed before stopping
        self.preempted = False

    def _log(self, event: Event, **fields: Any) -> None:
        log_event(self.spec.run_uri, event, **fields)

    def run(self) -> RunResult:
        start_time = time.perf_counter()
        restored = self.checkpoints.restore(self.engine)
        if restored is not None:
            self.state = TrainState(restored.step, restored.samples_seen, self.slots)
        decays = decayed(self.engine.model)
        self.servers = [ParameterServer.remote(self.spec, names, decays) for names in self.parts]
        self.coordinator = None
        try:
            self._load_servers()
            cut_every = self.spec.checkpoint.every_n_steps * self.global_batch
            self.coordinator = Coordinator.remote(self.state.samples_seen, self.spec.run.steps * self.global_batch,
                                                  worker_batch(self.spec), cut_every,
                                                  self.spec.parallelism.max_staleness, self.spec.scaling.world_sizes[0])
            self._log(Event.START, restored_step=self.state.step,
                      old_world_size=restored.world_size if restored else None, world_size=self.slots,
                      min_workers=self.spec.scaling.world_sizes[0], num_servers=len(self.servers),
                      max_staleness=self.spec.parallelism.max_staleness)
            for _ in range(self.slots):
                self._start_worker()
            self._train()
        finally:
            # Pending workers never started, the others are done: nothing of the run stays behind.
            for actor in [*self.servers, self.coordinator, *(actor for _, actor in self.running.values())]:
                if actor is not None:  # the coordinator, when the servers failed before it started
                    ray.kill(actor)
        return finish_run(self.spec, f"shardyard run '{self.spec.run.name}' (parameter_server)", start_time)

    def _load_servers(self) -> None:
        """Every server takes its partition of the driver's model and optimizer state."""
        optimizer_state = self.engine.optimizers[0].state
        version = self.state.step * self.slots
        _once_servers_answer(lambda: ray.get([
            server.load.remote([self.params[n].detach() for n in names],
                               [optimizer_state.get(self.params[n], {}) for n in names], version, self.generation)
            for server, names in zip(self.servers, self.parts)]))

    def _start_worker(self) -> None:
        # Every slot gets an actor at once: one that finds no resources is pending and joins
        # the run when a node brings some (elastic growth).
        name = f"worker{self.next_worker}"
        actor = PSWorker.options(**worker_resources(self.spec)).remote(
            self.spec, name, self.servers, self.parts, self.coordinator, self.attempt)
        self.running[actor.run.remote()] = (name, actor)
        self.next_worker += 1

    def _train(self) -> None:
        cadence = Cadence(self.spec, self.state.step, writes=True, progress_bar=sys.stdout.isatty())
        tokens_per_sample = getattr(self.spec.model, "block_size", 1)
        losses: dict[int, list[float]] = {}  # step -> the losses of its batches
        staleness: list[int] = []
        last_loss = float("nan")
        server_pids = [s["pid"] for s in self._statuses()]
        while self.state.step < self.spec.run.steps and not self.preempted:
            self._replace_dead_workers()
            self._notice_preemption()
            report = ray.get(self.coordinator.progress.remote())
            for name in report["joined"]:
                self._log(Event.WORKER_JOINED, worker=name, step=self.state.step, workers=report["workers"])
            statuses = self._statuses()
            if [s["pid"] for s in statuses] != server_pids:
                self._roll_back()
                server_pids = [s["pid"] for s in self._statuses()]
                losses.clear()
                continue
            rolled_back = False
            for offset, loss in report["losses"]:
                if not math.isfinite(loss):  # run.on_nonfinite: stop (the spec offers no skip here)
                    raise Diverged.at(offset // self.global_batch + 1, "the loss is", can_skip=False)
                losses.setdefault(offset // self.global_batch + 1, []).append(loss)
            staleness += [s for status in statuses for s in status["staleness"]]
            reached = report["samples"] // self.global_batch
            # Steps arrive several per report: every row logged from this report gets the rate
            # since the previous one (read per row, the rows after the first would count their
            # steps over no time at all).
            for _ in range(reached - self.state.step):
                cadence.stepped(self.global_batch, self.global_batch * tokens_per_sample)
            rate = cadence.rate() if reached > self.state.step else {}
            while self.state.step < reached:
                self.state.step += 1
                self.state.samples_seen = self.state.step * self.global_batch
                step = self.state.step
                due = cadence.due(step, checkpoint_now=step == self.preempt_step)
                if not due.row:
                    continue
                # Batches finish out of order: a row takes every loss of its steps and earlier
                # ones not yet counted (only if none arrived, the previous row's loss again).
                window = [x for s in sorted(k for k in losses if k <= step) for x in losses.pop(s)]
                loss = sum(window) / len(window) if window else last_loss
                last_loss = loss
                cadence.record({
                    "step": step, "loss": loss, "lr": statuses[0]["lr"], "world_size": report["workers"],
                    "global_batch": self.global_batch, "samples_seen": self.state.samples_seen,
                    # Updates the servers applied since the last row (none: several rows at once).
                    "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
                    "staleness_max": max(staleness) if staleness else None,
                    "largest_clock_gap": report["largest_gap"], **rate})
                staleness = []
                if due.checkpoint and not self._checkpoint():
                    rolled_back = True
                    break
                if step == self.preempt_step:
                    self.preempted = True
                    self._log(Event.PREEMPTED, step=step)
                    break
            if rolled_back:
                server_pids = [s["pid"] for s in self._statuses()]
                losses.clear()
            elif not report["at_cut"]:
                time.sleep(0.2)
        cadence.close()

    def _notice_preemption(self) -> None:
        """The Trainer's guard, asked between reports: a launch that lost the run's lease stops at
        once; at the driver's SIGTERM notice (`<run>/PREEMPT`) the run cuts at the step now being
        computed, checkpoints it and stops."""
        verdict = self.guard.check(torch.zeros(()), None)
        if verdict.lease_lost is not None:
            raise LeaseLost(verdict.lease_lost)
        if self.preempt_step is None and verdict.preempt:
            cut = ray.get(self.coordinator.cut_now.remote(self.global_batch))
            self.preempt_step = max(cut // self.global_batch, self.state.step)
            if self.preempt_step == self.state.step:  # nothing handed out past it: checkpoint it now
                if self._checkpoint():
                    self.preempted = True
                    self._log(Event.PREEMPTED, step=self.state.step)
                else:  # rolled back meanwhile: cut again from where it went back to
                    self.preempt_step = None

    def _replace_dead_workers(self) -> None:
        if not self.running:
            return
        done, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=0)
        for ref in done:
            name, _ = self.running.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:  # the worker died: its batch is handed out again
                self.failures += 1
                ray.get(self.coordinator.leave.remote(name))
                self._log(Event.FAILURE, worker=name, step=self.state.step, error=type(err).__name__)
                if self.failures > self.spec.scaling.max_failures:
                    raise RuntimeError(f"{self.failures} parameter-server workers failed; scaling.max_failures "
                                       f"is {self.spec.scaling.max_failures}") from err
                self._start_worker()  # the replacement joins when there is room for it

    def _checkpoint(self) -> bool:
        """The cut at this step: every server's partition, all of this stretch's pushes applied.
        False if a server restarted meanwhile: the run was rolled back instead."""
        cut = self.state.samples_seen
        snapshots = _once_servers_answer(lambda: ray.get([s.snapshot.remote(cut) for s in self.servers]))
        if any(generation != self.generation for generation, _, _ in snapshots):
            self._roll_back()
            return False
        if not all(torch.isfinite(t).all() for _, tensors, _ in snapshots for t in tensors):
            raise Diverged.at(self.state.step, "the weights are", can_skip=False)
        optimizer = self.engine.optimizers[0]
        with torch.no_grad():
            for names, (_, tensors, states) in zip(self.parts, snapshots):
                for name, value, state in zip(names, tensors, states):
                    self.params[name].copy_(value)
                    optimizer.state[self.params[name]] = state
        # The schedule as a synchronous run's at this step, so any strategy resumes from it.
        Schedule(self.engine.schedulers).resume_at(self.state.step)
        if self.ledger is not None:
            # Before the checkpoint commits: a job killed between the two would otherwise resume
            # after steps whose commit lines it never wrote. Lines for a checkpoint that then fails
            # to commit are harmless: the launch that redoes those steps is a later attempt.
            first = (self.state.step - 1) // self.spec.checkpoint.every_n_steps * self.spec.checkpoint.every_n_steps
            for step in range(first + 1, self.state.step + 1):
                self.ledger.committed(step, self.generation)
        self.checkpoints.save(self.engine, self.state, self.spec)
        ray.get(self.coordinator.advance.remote())
        return True

    def _roll_back(self) -> None:
        """A server restarted empty: every server and the coordinator go back to the newest
        committed checkpoint (or the start), under a new generation that refuses older pushes."""
        name = newest_name(self.checkpoints.storage)
        if name is not None:
            self.state = self.checkpoints.load(self.engine, name)
            self.state.world_size = self.slots
        else:
            self.engine = single_process(self.spec, initial_model(self.spec), torch.device("cpu"))
            self.params = dict(self.engine.model.named_parameters())
            self.state = TrainState(world_size=self.slots)
        self.generation += 1
        self._load_servers()
        ray.get(self.coordinator.rollback.remote(self.state.samples_seen, self.generation))
        self._log(Event.SERVER_RESTORED, restored_from=name, step=self.state.step, generation=self.generation)

    def _statuses(self) -> list[dict[str, Any]]:
        return _once_servers_answer(lambda: ray.get([s.status.remote() for s in self.servers]))


# A restarted server answers within seconds; one that has not for this long fails each restart
# (a fault of its own, such as its constructor raising), and waiting on would hang the run.
SERVER_RECOVERY_S = 120.0


def _once_servers_answer(call: Callable[[], Any], timeout_s: float = SERVER_RECOVERY_S) -> Any:
    """`call()`, again while a server is being restarted, until it succeeds or `timeout_s` pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except SERVER_LOST as err:
            if time.monotonic() > deadline:
                raise RuntimeError(f"a parameter server has not answered for {timeout_s:g} s: it fails "
                                   f"each time it restarts ({type(err).__name__}: {err})") from None
            time.sleep(0.5)


def run(spec: JobSpec, fence: Fence | None = None) -> RunResult:
    """Train `spec` with parameter servers on the connected Ray cluster. `fence` raises once the
    run's lease is lost (nothing is committed after)."""
    return ParameterServerRun(spec, fence).run()
