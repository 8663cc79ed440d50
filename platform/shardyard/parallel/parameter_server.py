"""Asynchronous data parallelism through parameter servers (`strategy: parameter_server`).

The parameters are partitioned by tensor over K `ParameterServer` actors, balanced by size. Each
`PSWorker` actor loops: ask the `Coordinator` for the next batch, pull the current parameters
from every server, compute its batch's gradient, push each server its part. A server applies
each gradient with its own optimizer the moment it arrives (one at a time: actor calls run in
order) and records its staleness, the number of updates it applied between that worker's pull
and this push.

The coordinator hands out the global sample order in worker-sized batches, so every sample is
used once per epoch however unevenly the workers run, and a dead worker's unfinished batch is
handed out again. With `max_staleness: S` it holds back a worker more than S pushes ahead of the
slowest live one (stale-synchronous parallel); then, with W workers, no gradient is more than
(W - 1)(2S + 1) updates stale: while one worker computes, each other can push at most 2S + 1
times before it must wait. With S null nobody waits (fully asynchronous).

Each worker batch is global_batch / W samples, W the worker slots (scaling.num_workers, or
max_workers when elastic), and each push one optimizer step, so a global step (one global batch
of data) is W updates however many workers are alive; with one worker and S = 0 this is
single-process training exactly. Workers clip their own gradient before pushing.

Workers come and go while training runs. Every slot gets an actor holding
scaling.resources_per_worker; one that finds no room waits in Ray's queue and joins when a node
brings some. Training starts once min_workers have joined. A worker that dies is replaced by a
new actor, which joins the same way.

Checkpoints have the usual layout (the whole model through DCP, trainer state, spec), so serving
and `shardyard export` read them unchanged, plus each server's snapshot (its tensors, optimizer
and schedule) under `ps/`. A server that dies is restarted by Ray and restores its partition from
the latest checkpoint; updates it applied since are lost (the other partitions keep theirs).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from torch import nn

from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.models import build_model
from shardyard.spec import JobSpec, parse_spec
from shardyard.train.optim import build_optimizer, build_scheduler

SNAPSHOT_DIR = "ps"
# What a call to a server that died raises, before and while Ray restarts it.
SERVER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


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


def total_updates(spec: JobSpec) -> int:
    return spec.run.steps * worker_slots(spec)


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
def load_pulled(params: dict[str, nn.Parameter], parts: list[list[str]],
                pulled: list[tuple[int, list[torch.Tensor]]]) -> None:
    """Copy every server's (version, tensors) answer to `pull` into the named parameters."""
    for names, (_, tensors) in zip(parts, pulled):
        for name, value in zip(names, tensors):
            params[name].copy_(value)


@ray.remote(max_restarts=-1)  # a dead server comes back and restores from the latest checkpoint
class ParameterServer:
    def __init__(self, spec: dict[str, Any], index: int, names: list[str]) -> None:
        from shardyard.train.checkpoint import find_latest, load_model

        self.spec = parse_spec(spec)
        self.index, self.names = index, names
        full = dict(initial_model(self.spec).named_parameters())
        self.params = [nn.Parameter(full[n].detach().clone()) for n in names]
        self.optimizer = build_optimizer(self.params, self.spec.optim)
        self.scheduler = build_scheduler(self.optimizer, self.spec.optim, total_updates(self.spec))
        self.version = 0
        self.staleness: list[int] = []
        self.restored_from: str | None = None
        latest = find_latest(self.spec.run_dir)
        if latest is None:
            return
        snapshot = latest / SNAPSHOT_DIR / f"server{index}.pt"
        state = torch.load(snapshot, weights_only=True) if snapshot.is_file() else None
        if state is not None and state["names"] == names:
            with torch.no_grad():
                for p, value in zip(self.params, state["params"]):
                    p.copy_(value)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.version = state["version"]
        else:  # written with another partition: the weights carry over, the optimizer starts afresh
            saved = dict(load_model(latest).named_parameters())
            with torch.no_grad():
                for p, name in zip(self.params, names):
                    p.copy_(saved[name])
        self.restored_from = latest.name

    def pull(self) -> tuple[int, list[torch.Tensor]]:
        return self.version, [p.detach() for p in self.params]

    def push(self, grads: list[torch.Tensor], pulled_version: int) -> int:
        """Apply one worker's gradient for this partition; return its staleness."""
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        staleness = self.version - pulled_version
        self.version += 1
        self.staleness.append(staleness)
        return staleness

    def snapshot(self, directory: str) -> None:
        path = Path(directory) / SNAPSHOT_DIR / f"server{self.index}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"names": self.names, "params": [p.detach() for p in self.params],
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "version": self.version}, path)

    def status(self) -> dict[str, Any]:
        """Version, learning rate, staleness of the updates since the last call, restore source."""
        recent, self.staleness = self.staleness, []
        return {"version": self.version, "lr": self.optimizer.param_groups[0]["lr"], "staleness": recent,
                "restored_from": self.restored_from, "pid": os.getpid()}


@ray.remote
class Coordinator:
    """Hands out batches (offsets into the global sample order) and keeps the staleness bound."""

    def __init__(self, start: int, end: int, batch: int, max_staleness: int | None, min_workers: int) -> None:
        self.next_offset, self.end, self.batch, self.bound = start, end, batch, max_staleness
        self.min_workers, self.started = min_workers, False
        self.joined: list[str] = []            # workers that joined since the last progress()
        self.clocks: dict[str, int] = {}       # pushes done by each worker still taking batches
        self.live: set[str] = set()            # workers that joined and have not died
        self.outstanding: dict[str, int] = {}  # the batch each worker is computing
        self.returned: list[int] = []          # batches of workers that died, to hand out again
        self.finished_samples = start
        self.losses: list[tuple[int, float]] = []  # (batch offset, loss) since the last progress()
        self.largest_gap = 0
        self.changed = asyncio.Condition()

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

    async def next_batch(self, worker: str) -> int | None:
        """The offset of this worker's next batch (None: no data left), once it may go on."""
        async with self.changed:
            # Training starts once min_workers are there; later, whoever is there trains on.
            await self.changed.wait_for(lambda: self.started or len(self.clocks) >= self.min_workers)
            self.started = True
            if self.bound is not None:
                await self.changed.wait_for(lambda: worker not in self.clocks or self._gap(worker) <= self.bound)
            if worker not in self.clocks:
                return None
            self.largest_gap = max(self.largest_gap, self._gap(worker))
            if self.returned:
                offset = self.returned.pop(0)
            elif self.next_offset < self.end:
                offset, self.next_offset = self.next_offset, self.next_offset + self.batch
            else:  # done: out of the staleness bound's minimum, so nobody waits for it
                self.clocks.pop(worker)
                self.changed.notify_all()
                return None
            self.outstanding[worker] = offset
            return offset

    async def finished(self, worker: str, loss: float) -> None:
        async with self.changed:
            self.clocks[worker] += 1
            self.losses.append((self.outstanding.pop(worker), loss))
            self.finished_samples += self.batch
            self.changed.notify_all()

    def progress(self) -> dict[str, Any]:
        losses, self.losses = self.losses, []
        joined, self.joined = self.joined, []
        return {"samples": self.finished_samples, "losses": losses, "largest_gap": self.largest_gap,
                "workers": len(self.live), "joined": joined}


@ray.remote
class PSWorker:
    """Pulls, computes one batch's gradient, pushes; until the coordinator has no batch left."""

    def __init__(self, spec: dict[str, Any], name: str, servers: list, parts: list[list[str]], coordinator,
                 slowdown: float = 1.0) -> None:
        from shardyard.parallel import single_process

        self.spec = parse_spec(spec)
        self.name, self.servers, self.parts, self.coordinator = name, servers, parts, coordinator
        self.slowdown = slowdown  # > 1 makes this worker a deliberate straggler (benchmarks)
        model = initial_model(self.spec)
        self.params = dict(model.named_parameters())
        # The single-process engine's forward/backward and clipping; its optimizer stays unused.
        self.engine = single_process(self.spec, model, torch.device("cpu"))
        self.dataset = build_dataset(self.spec)
        self.order = GlobalSampleOrder(len(self.dataset), self.spec.run.seed)
        self.accum = worker_batch(self.spec) // self.spec.batch.micro_batch_size

    def run(self) -> int:
        ray.get(self.coordinator.join.remote(self.name))
        done = 0
        while (offset := ray.get(self.coordinator.next_batch.remote(self.name))) is not None:
            # A server that dies mid-call: once Ray has restarted it, pull and compute again.
            loss = _once_servers_answer(lambda: self._train_on(offset))
            ray.get(self.coordinator.finished.remote(self.name, loss))
            done += 1
        return done

    def _train_on(self, offset: int) -> float:
        pulled = ray.get([server.pull.remote() for server in self.servers])
        load_pulled(self.params, self.parts, pulled)
        ids = micro_batch_ids(self.order, offset, 0, 1, self.spec.batch.micro_batch_size, self.accum)
        started = time.perf_counter()
        for p in self.params.values():
            p.grad = None
        loss = self.engine.forward_backward([self.dataset.batch(i) for i in ids])
        if self.spec.optim.grad_clip > 0:
            self.engine.clip_grad_norm(self.spec.optim.grad_clip)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        ray.get([server.push.remote([self.params[n].grad for n in names], version)
                 for server, names, (version, _) in zip(self.servers, self.parts, pulled)])
        return loss.item()


def run(spec: JobSpec, slowdowns: dict[int, float] | None = None) -> Any:
    """Train `spec` with parameter servers on the connected Ray cluster; a RunResult like launch's.
    `slowdowns` maps worker index to a slowdown factor (benchmarks' deliberate stragglers)."""
    from shardyard.parallel import single_process
    from shardyard.train import checkpoint
    from shardyard.train.checkpoint import TrainState
    from shardyard.train.launcher import RunResult
    from shardyard.train.metrics import (
        MetricsFile, MetricsLog, Progress, Throughput, format_table, log_event, summarize,
    )

    start_time = time.perf_counter()
    raw = spec.model_dump(mode="json")
    with torch.device("meta"):  # sizes only: the servers build the weights themselves
        shape = build_model(spec.model)
    parts = partition({n: p.numel() for n, p in shape.named_parameters()}, spec.parallelism.num_servers)
    latest = checkpoint.find_latest(spec.run_dir)
    meta = torch.load(latest / checkpoint.STATE_FILE, weights_only=True) if latest else {}
    slots, min_workers = worker_slots(spec), spec.scaling.world_sizes[0]
    state = TrainState(meta.get("step", 0), meta.get("samples_seen", 0), slots)
    global_batch = spec.batch.global_batch_size
    servers = [ParameterServer.remote(raw, k, names) for k, names in enumerate(parts)]
    coordinator = Coordinator.remote(state.samples_seen, spec.run.steps * global_batch, worker_batch(spec),
                                     spec.parallelism.max_staleness, min_workers)
    server_pids = _statuses(servers)  # started (and restored); a changed pid later means restarted
    log_event(spec.checkpoint.storage_path, spec.run.name, "start", restored_step=state.step,
              old_world_size=meta.get("world_size"), world_size=slots, min_workers=min_workers,
              num_servers=len(servers), max_staleness=spec.parallelism.max_staleness)

    slowdowns = slowdowns or {}
    running: dict[ray.ObjectRef, tuple[str, Any]] = {}

    def start_worker(index: int) -> None:
        # Every slot gets an actor at once: one that finds no resources is pending and joins
        # the run when a node brings some (elastic growth).
        name = f"worker{index}"
        actor = PSWorker.options(**worker_resources(spec)).remote(
            raw, name, servers, parts, coordinator, slowdowns.get(index, 1.0))
        running[actor.run.remote()] = (name, actor)

    for i in range(slots):
        start_worker(i)
    next_index, failures = slots, 0
    log = MetricsLog(MetricsFile(spec.checkpoint.storage_path, spec.run.name), state.step)
    progress = Progress(spec.run.steps, state.step, sys.stdout.isatty())
    throughput = Throughput()
    tokens_per_sample = getattr(spec.model, "block_size", 1)
    losses: dict[int, list[float]] = {}  # step -> the losses of its batches
    staleness: list[int] = []
    since_report, last_loss = 0, float("nan")
    while state.step < spec.run.steps:
        done, _ = ray.wait(list(running), num_returns=1, timeout=0.2)
        for ref in done:
            name, actor = running.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:  # the worker died: hand its batch out again
                failures += 1
                ray.get(coordinator.leave.remote(name))
                log_event(spec.checkpoint.storage_path, spec.run.name, "failure", worker=name, step=state.step,
                          error=type(err).__name__)
                if failures > spec.scaling.max_failures:
                    raise RuntimeError(f"{failures} parameter-server workers failed; scaling.max_failures "
                                       f"is {spec.scaling.max_failures}") from err
                start_worker(next_index)  # the replacement joins when there is room for it
                next_index += 1
        report = ray.get(coordinator.progress.remote())
        for name in report["joined"]:
            log_event(spec.checkpoint.storage_path, spec.run.name, "worker_joined", worker=name,
                      step=state.step, workers=report["workers"])
        for offset, loss in report["losses"]:
            losses.setdefault(offset // global_batch + 1, []).append(loss)
        statuses = _statuses(servers)
        for before, now in zip(server_pids, statuses):
            if now["pid"] != before["pid"]:
                log_event(spec.checkpoint.storage_path, spec.run.name, "server_restored",
                          restored_from=now["restored_from"], version=now["version"], step=state.step)
        server_pids = statuses
        staleness += [s for status in statuses for s in status["staleness"]]
        reached = report["samples"] // global_batch
        while state.step < reached:
            state.step += 1
            state.samples_seen = state.step * global_batch
            throughput.add(global_batch, global_batch * tokens_per_sample)
            since_report += 1
            last = state.step == spec.run.steps
            save_now = last or state.step % spec.checkpoint.every_n_steps == 0
            if not (save_now or state.step % spec.run.log_every == 0):
                continue
            # Batches finish out of order: a row takes every loss of its steps and earlier ones
            # not yet counted (only if none arrived, the previous row's loss again).
            window = [x for step in sorted(k for k in losses if k <= state.step) for x in losses.pop(step)]
            loss = sum(window) / len(window) if window else last_loss
            last_loss = loss
            metrics = {"step": state.step, "loss": loss,
                       "lr": statuses[0]["lr"], "world_size": report["workers"], "global_batch": global_batch,
                       "samples_seen": state.samples_seen,
                       # Updates the servers applied since the last row (none: several rows at once).
                       "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
                       "staleness_max": max(staleness) if staleness else None,
                       "largest_clock_gap": report["largest_gap"], **throughput.read()}
            staleness = []
            log.append(metrics)  # before the checkpoint completes: a run resumed from it has this row
            progress.update(since_report, metrics)
            since_report = 0
            if save_now:
                _once_servers_answer(lambda: _save(spec, state, servers, parts, single_process, checkpoint))
    progress.close()
    title = f"shardyard run '{spec.run.name}' (parameter_server)"
    summary = summarize(MetricsFile(spec.checkpoint.storage_path, spec.run.name), title,
                        time.perf_counter() - start_time)
    latest = checkpoint.find_latest(spec.run_dir)
    summary["checkpoint"] = str(latest) if latest else None
    print(format_table(title, summary), flush=True)
    # Workers still pending for resources never started; the others are done.
    for actor in [*servers, coordinator, *(actor for _, actor in running.values())]:
        ray.kill(actor)
    return RunResult(spec.run_dir, summary["checkpoint"], summary)


def _once_servers_answer(call: Callable[[], Any]) -> Any:
    """`call()`, again and again while a server is being restarted, until it succeeds."""
    while True:
        try:
            return call()
        except SERVER_LOST:
            time.sleep(0.5)


def _statuses(servers: list) -> list[dict[str, Any]]:
    return _once_servers_answer(lambda: ray.get([s.status.remote() for s in servers]))


def _save(spec: JobSpec, state, servers: list, parts: list[list[str]], single_process, checkpoint) -> None:
    """The whole model (pulled from every server) in the usual checkpoint layout, plus each
    server's snapshot, written atomically."""
    model = initial_model(spec)
    load_pulled(dict(model.named_parameters()), parts, ray.get([s.pull.remote() for s in servers]))
    engine = single_process(spec, model, torch.device("cpu"))
    name = f"{checkpoint.DIR_PREFIX}{state.step:08d}"
    with warnings.catch_warnings():  # DCP notes that it writes from one process: it is meant to
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        checkpoint.write_in_place(engine, state, spec, name,
                                  also=lambda d: ray.get([s.snapshot.remote(str(d)) for s in servers]))
