"""Asynchronous data parallelism through parameter servers (`strategy: parameter_server`).

The parameters are partitioned by tensor over K `ParameterServer` actors, balanced by size. Each
`PSWorker` actor loops: ask the `Coordinator` for the next batch, pull the current parameters
from every server, compute its batch's gradient, push each server its part. A server applies
each gradient with its own optimizer the moment it arrives (one at a time: actor calls run in
order) and records its staleness, the number of updates it applied between that worker's pull
and this push. With `max_staleness: S` the coordinator holds back a worker more than S pushes
ahead of the slowest live one (stale-synchronous parallel); with W workers no gradient is then
more than (W - 1)(2S + 1) updates stale. With S null nobody waits (fully asynchronous).

Each worker batch is global_batch / W samples (W the worker slots: scaling.num_workers, or
max_workers when elastic) and each push one optimizer step, so a global step is W updates however
many workers are alive; one worker with S = 0 is single-process training exactly.

Exactly once, across failures:
- Every push carries an id, (generation, batch offset). A server applies an id at most once: a
  worker that died after pushing to some servers has its batch handed out again, and the servers
  that applied it already skip the retry's push.
- Checkpoints are consistent cuts. The coordinator hands out batches only up to the next
  checkpoint boundary; once every batch below it is applied everywhere, the driver pulls every
  server's parameters and optimizer state and writes them through the Trainer's
  `CheckpointManager`, in the same layout as every other strategy (so any strategy resumes from
  it and it resumes from any), then opens the next stretch.
- A server that dies comes back empty (Ray restarts it). The driver then rolls the whole run back
  to the newest committed checkpoint under a new generation: every server reloads it, the
  coordinator restarts at its position, and pushes of the old generation are refused. A worker
  that dies is replaced by a new actor; workers join whenever a node brings room for one.
- With `run.sample_ledger`, workers record each batch's samples once all its pushes are applied,
  and the driver commits the steps of each cut: the audit then checks every sample of each epoch
  was used exactly once.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import ray
import torch
from torch import nn

from shardyard.checkpoint.record import newest_name
from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.data.ledger import SampleLedger
from shardyard.models import build_model
from shardyard.parallel import Engine, single_process
from shardyard.spec import JobSpec
from shardyard.checkpoint.manager import CheckpointManager, Fence
from shardyard.checkpoint.layout import TrainState
from shardyard.storage.events import Event, log_event
from shardyard.train.metrics import MetricsLog, Progress, RunResult, Throughput, finish_run
from shardyard.train.step_guard import PREEMPT_FILE, Diverged
from shardyard.optim import decay_groups, decayed, lr_factor, optimizer_over

# What a call to a server that died raises, before and while Ray restarts it.
SERVER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
PushId = tuple[int, int]  # (generation, batch offset)


def partition(sizes: dict[str, int], k: int) -> list[list[str]]:
    """Tensor names onto k servers: largest first, each onto the least loaded so far."""
    parts: list[list[str]] = [[] for _ in range(k)]
    loads = [0] * k
    for name, size in sorted(sizes.items(), key=lambda item: -item[1]):
        i = loads.index(min(loads))
        parts[i].append(name)
        loads[i] += size
    return parts


def worker_slots(spec: JobSpec) -> int:
    """Workers the run may have at once: scaling.num_workers, or max_workers when elastic."""
    return spec.scaling.world_sizes[-1]


def worker_batch(spec: JobSpec) -> int:
    return spec.batch.global_batch_size // worker_slots(spec)


def worker_resources(spec: JobSpec) -> dict[str, Any]:
    """Ray actor options holding scaling.resources_per_worker while a worker lives: a worker with
    no room waits (pending) until a node brings some."""
    resources = dict(spec.scaling.resources_per_worker)
    return {"num_cpus": resources.pop("CPU", 1.0), "num_gpus": resources.pop("GPU", 0.0),
            "resources": resources}


def initial_model(spec: JobSpec) -> nn.Module:
    torch.manual_seed(spec.run.seed)  # every actor builds the same initial weights
    return build_model(spec.model)


@torch.no_grad()
def load_pulled(params: dict[str, nn.Parameter], parts: list[list[str]], pulled: list[list[torch.Tensor]]) -> None:
    """Copy every server's tensors into the named parameters."""
    for names, tensors in zip(parts, pulled):
        for name, value in zip(names, tensors):
            params[name].copy_(value)


@ray.remote(max_restarts=-1)  # a dead server comes back empty; the driver rolls the run back
class ParameterServer:
    def __init__(self, spec: JobSpec, names: list[str], decays: dict[str, bool]) -> None:
        self.spec = spec  # validated on the driver
        self.slots = worker_slots(self.spec)
        self.names = names
        with torch.device("meta"):  # shapes only: the weights come from the driver's `load`
            full = dict(build_model(self.spec.model).named_parameters())
        self.params = {n: nn.Parameter(torch.empty_like(full[n], device="cpu")) for n in names}
        self.optimizer = optimizer_over(decay_groups(self.params, decays, self.spec.optim.weight_decay),
                                        self.spec.optim)
        self.generation = -1  # refuses every push until loaded
        self.version = 0
        self.applied: set[int] = set()  # batch offsets applied in this generation
        self.staleness: list[int] = []

    def load(self, tensors: list[torch.Tensor], states: list[dict[str, torch.Tensor]], version: int,
             generation: int) -> None:
        """Take this partition's weights and optimizer state (from a checkpoint, or initial)."""
        with torch.no_grad():
            for name, value, state in zip(self.names, tensors, states):
                self.params[name].copy_(value)
                self.optimizer.state[self.params[name]] = {k: v.clone() for k, v in state.items()}
        self.version, self.generation, self.applied = version, generation, set()

    def pull(self) -> tuple[int, int, list[torch.Tensor]]:
        return self.generation, self.version, [p.detach() for p in self.params.values()]

    def push(self, grads: list[torch.Tensor], push_id: PushId, pulled_version: int) -> str:
        """Apply one worker's gradient for this partition once: 'applied', 'duplicate' (a retry of
        an id already applied) or 'refused' (an older generation's, after a rollback)."""
        generation, offset = push_id
        if generation != self.generation:
            return "refused"
        if offset in self.applied:
            return "duplicate"
        for group in self.optimizer.param_groups:  # the schedule of the global step this is part of
            group["lr"] = self.spec.optim.lr * lr_factor(self.version // self.slots, self.spec.optim,
                                                         self.spec.run.steps)
        for p, g in zip(self.params.values(), grads):
            p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.staleness.append(self.version - pulled_version)
        self.version += 1
        self.applied.add(offset)
        return "applied"

    def snapshot(self, cut: int) -> tuple[int, list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """This partition's generation, weights and optimizer state, all pushes below offset `cut`
        applied; ids below the cut are never retried again, so they are forgotten."""
        self.applied = {offset for offset in self.applied if offset >= cut}
        return (self.generation, [p.detach().clone() for p in self.params.values()],
                [dict(self.optimizer.state.get(p, {})) for p in self.params.values()])

    def status(self) -> dict[str, Any]:
        """Version, learning rate, staleness of the updates since the last call, process id."""
        recent, self.staleness = self.staleness, []
        return {"version": self.version, "lr": self.optimizer.param_groups[0]["lr"], "staleness": recent,
                "generation": self.generation, "pid": os.getpid()}


@ray.remote
class Coordinator:
    """Hands out batches (offsets into the global sample order) up to the next checkpoint cut,
    and keeps the staleness bound."""

    def __init__(self, start: int, end: int, batch: int, cut_every: int, max_staleness: int | None,
                 min_workers: int) -> None:
        self.end, self.batch, self.cut_every, self.bound = end, batch, cut_every, max_staleness
        self.min_workers, self.started = min_workers, False
        self.joined: list[str] = []            # workers that joined since the last progress()
        self.clocks: dict[str, int] = {}       # pushes done by each worker still taking batches
        self.live: set[str] = set()            # workers that joined and have not died
        self.losses: list[tuple[int, float]] = []  # (batch offset, loss) since the last progress()
        self.largest_gap = 0
        self.changed = asyncio.Condition()
        self._restart(start, generation=0)

    def _restart(self, start: int, generation: int) -> None:
        self.generation = generation
        self.next_offset = self.finished_samples = start
        self.limit = min(self.end, (start // self.cut_every + 1) * self.cut_every)
        self.outstanding: dict[str, int] = {}  # the batch each worker is computing
        self.returned: list[int] = []          # batches to hand out again

    async def join(self, worker: str) -> None:
        async with self.changed:  # a newcomer starts level with the slowest: nobody waits for it
            self.clocks[worker] = min(self.clocks.values(), default=0)
            self.live.add(worker)
            self.joined.append(worker)
            self.changed.notify_all()

    async def leave(self, worker: str) -> None:
        async with self.changed:
            self.clocks.pop(worker, None)
            self.live.discard(worker)
            if (offset := self.outstanding.pop(worker, None)) is not None:
                self.returned.append(offset)
            self.changed.notify_all()

    def _gap(self, worker: str) -> int:
        return self.clocks[worker] - min(self.clocks.values())

    def _has_work(self) -> bool:
        return bool(self.returned) or self.next_offset < self.limit

    def _done(self) -> bool:
        return not self.returned and self.next_offset >= self.end

    async def next_batch(self, worker: str) -> tuple[int, int] | None:
        """(generation, offset) of this worker's next batch, once it may go on; None: no data left."""
        async with self.changed:
            # Training starts once min_workers are there; later, whoever is there trains on.
            await self.changed.wait_for(lambda: self.started or len(self.clocks) >= self.min_workers)
            self.started = True
            await self.changed.wait_for(lambda: worker not in self.clocks or self._done() or (
                self._has_work() and (self.bound is None or self._gap(worker) <= self.bound)))
            if worker not in self.clocks or self._done():
                # Out of the staleness bound's minimum, so nobody waits for it.
                self.clocks.pop(worker, None)
                self.changed.notify_all()
                return None
            self.largest_gap = max(self.largest_gap, self._gap(worker))
            if self.returned:
                offset = self.returned.pop(0)
            else:
                offset, self.next_offset = self.next_offset, self.next_offset + self.batch
            self.outstanding[worker] = offset
            return self.generation, offset

    async def finished(self, worker: str, generation: int, loss: float | None) -> None:
        """The worker's batch is applied on every server (`loss`), or was refused (None)."""
        async with self.changed:
            offset = self.outstanding.pop(worker, None)
            if generation == self.generation and offset is not None:
                if loss is None:
                    self.returned.append(offset)
                else:
                    self.clocks[worker] += 1
                    self.losses.append((offset, loss))
                    self.finished_samples += self.batch
            self.changed.notify_all()

    async def advance(self) -> None:
        """The cut is checkpointed: hand out batches up to the next one."""
        async with self.changed:
            self.limit = min(self.end, self.limit + self.cut_every)
            self.changed.notify_all()

    async def cut_now(self, global_batch: int) -> int:
        """Hand out nothing past the step now being computed (a preemption): the samples at which
        the run checkpoints and stops."""
        async with self.changed:
            self.limit = min(self.limit, -(-self.next_offset // global_batch) * global_batch)
            self.changed.notify_all()
            return self.limit

    async def rollback(self, start: int, generation: int) -> None:
        async with self.changed:
            self._restart(start, generation)
            self.losses = []
            self.changed.notify_all()

    def progress(self) -> dict[str, Any]:
        losses, self.losses = self.losses, []
        joined, self.joined = self.joined, []
        return {"samples": self.finished_samples, "at_cut": self.finished_samples == self.limit,
                "losses": losses, "largest_gap": self.largest_gap, "workers": len(self.live), "joined": joined}


@ray.remote
class PSWorker:
    """Pulls, computes one batch's gradient, pushes; until the coordinator has no batch left."""

    def __init__(self, spec: JobSpec, name: str, servers: list, parts: list[list[str]], coordinator,
                 attempt: float, slowdown: float = 1.0) -> None:
        self.spec = spec  # validated on the driver
        self.name, self.servers, self.parts, self.coordinator = name, servers, parts, coordinator
        self.slowdown = slowdown  # > 1 makes this worker a deliberate straggler (benchmarks)
        model = initial_model(self.spec)
        self.params = dict(model.named_parameters())
        # The single-process engine's forward/backward and clipping; its optimizer stays unused.
        self.engine = single_process(self.spec, model, torch.device("cpu"))
        self.dataset = build_dataset(self.spec)
        self.order = GlobalSampleOrder(len(self.dataset), self.spec.run.seed)
        self.accum = worker_batch(self.spec) // self.spec.batch.micro_batch_size
        self.ledger = SampleLedger(self.spec.run_uri, f"ps-{name}", attempt) if self.spec.run.sample_ledger else None

    def run(self) -> int:
        ray.get(self.coordinator.join.remote(self.name))
        done = 0
        while (batch := ray.get(self.coordinator.next_batch.remote(self.name))) is not None:
            generation, offset = batch
            try:
                loss = self._train_on(generation, offset)
            except SERVER_LOST:  # the driver rolls the run back; this batch is refused
                loss = None
            ray.get(self.coordinator.finished.remote(self.name, generation, loss))
            done += loss is not None
        return done

    def _train_on(self, generation: int, offset: int) -> float | None:
        pulled = ray.get([server.pull.remote() for server in self.servers])
        if any(g != generation for g, _, _ in pulled):
            return None
        load_pulled(self.params, self.parts, [tensors for _, _, tensors in pulled])
        ids = micro_batch_ids(self.order, offset, 0, 1, self.spec.batch.micro_batch_size, self.accum)
        started = time.perf_counter()
        for p in self.params.values():
            p.grad = None
        loss = self.engine.forward_backward([self.dataset.batch(i) for i in ids])
        if self.spec.optim.grad_clip > 0:
            self.engine.clip_grad_norm(self.spec.optim.grad_clip)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        answers = ray.get([server.push.remote([self.params[n].grad for n in names], (generation, offset), version)
                           for server, names, (_, version, _) in zip(self.servers, self.parts, pulled)])
        if "refused" in answers:
            return None
        if self.ledger is not None:
            step = offset // self.spec.batch.global_batch_size + 1
            self.ledger.training(step, worker_slots(self.spec), ids, generation)
        return loss.item()


class ParameterServerRun:
    """The driver: starts the actors, replaces dead workers, rolls back after a server died,
    checkpoints each cut and logs metrics like the Trainer."""

    def __init__(self, spec: JobSpec, slowdowns: dict[int, float] | None = None,
                 fence: Fence | None = None) -> None:
        self.spec = spec
        self.slowdowns = slowdowns or {}
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
            self.spec, name, self.servers, self.parts, self.coordinator, self.attempt,
            self.slowdowns.get(self.next_worker, 1.0))
        self.running[actor.run.remote()] = (name, actor)
        self.next_worker += 1

    def _train(self) -> None:
        log = MetricsLog(self.spec, self.state.step)
        progress = Progress(self.spec.run.steps, self.state.step, sys.stdout.isatty())
        throughput = Throughput()
        tokens_per_sample = getattr(self.spec.model, "block_size", 1)
        losses: dict[int, list[float]] = {}  # step -> the losses of its batches
        staleness: list[int] = []
        since_report, last_loss = 0, float("nan")
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
                    raise Diverged(f"the loss is not finite at step {offset // self.global_batch + 1} "
                                   f"(run.on_nonfinite: stop): nothing from this state was committed. Lower "
                                   f"optim.lr or set optim.grad_clip")
                losses.setdefault(offset // self.global_batch + 1, []).append(loss)
            staleness += [s for status in statuses for s in status["staleness"]]
            reached = report["samples"] // self.global_batch
            if reached > self.state.step:
                # Steps arrive several per report: each row logged from this report gets the
                # rate since the previous one (read per row, the rows after the first would
                # count their steps over no time at all).
                for _ in range(reached - self.state.step):
                    throughput.add(self.global_batch, self.global_batch * tokens_per_sample)
                rate = throughput.read()
            while self.state.step < reached:
                self.state.step += 1
                self.state.samples_seen = self.state.step * self.global_batch
                since_report += 1
                step = self.state.step
                save_now = step in (self.spec.run.steps, self.preempt_step) or step % self.spec.checkpoint.every_n_steps == 0
                if not (save_now or step % self.spec.run.log_every == 0):
                    continue
                # Batches finish out of order: a row takes every loss of its steps and earlier
                # ones not yet counted (only if none arrived, the previous row's loss again).
                window = [x for s in sorted(k for k in losses if k <= step) for x in losses.pop(s)]
                loss = sum(window) / len(window) if window else last_loss
                last_loss = loss
                metrics = {"step": step, "loss": loss, "lr": statuses[0]["lr"], "world_size": report["workers"],
                           "global_batch": self.global_batch, "samples_seen": self.state.samples_seen,
                           # Updates the servers applied since the last row (none: several rows at once).
                           "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
                           "staleness_max": max(staleness) if staleness else None,
                           "largest_clock_gap": report["largest_gap"], **rate}
                staleness = []
                log.append(metrics)  # before the checkpoint commits: a run resumed from it has this row
                progress.update(since_report, metrics)
                since_report = 0
                if save_now and not self._checkpoint():
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
        progress.close()
        log.close()

    def _notice_preemption(self) -> None:
        """At the driver's SIGTERM notice (`<run>/PREEMPT`), cut at the step now being computed:
        it is checkpointed, then the run stops."""
        if self.preempt_step is None and self.checkpoints.storage.exists(PREEMPT_FILE):
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
            raise Diverged(f"the weights are not finite at step {self.state.step} (run.on_nonfinite: stop): "
                           f"nothing from this state was committed")
        optimizer = self.engine.optimizers[0]
        with torch.no_grad():
            for names, (_, tensors, states) in zip(self.parts, snapshots):
                for name, value, state in zip(names, tensors, states):
                    self.params[name].copy_(value)
                    optimizer.state[self.params[name]] = state
        # The schedule as a synchronous run's at this step, so any strategy resumes from it.
        scheduler = self.engine.schedulers[0]
        scheduler.last_epoch = self.state.step - 1
        with warnings.catch_warnings():  # "scheduler stepped before the optimizer": meant here
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
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


def run(spec: JobSpec, slowdowns: dict[int, float] | None = None, fence: Fence | None = None) -> RunResult:
    """Train `spec` with parameter servers on the connected Ray cluster. `slowdowns` maps worker
    index to a slowdown factor (benchmarks' deliberate stragglers); `fence` raises once the run's
    lease is lost (nothing is committed after)."""
    return ParameterServerRun(spec, slowdowns, fence).run()
