"""The parameter-server run's Ray actors: the servers (each a partition of the parameters and
its optimizer), the coordinator (which batch goes to whom, up to each cut) and the workers."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
import torch
from torch import nn

from shardyard.data import build_dataset, micro_batch_ids, sample_order
from shardyard.data.ledger import SampleLedger
from shardyard.checkpoint.pretrained import pretrained_weights
from shardyard.models import build_model
from shardyard.optim import decay_groups, lr_factor, optimizer_over
from shardyard.parallel import single_process
from shardyard.spec import JobSpec

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
    return build_model(spec.model, pretrained_weights(spec.model))


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
                 attempt: float) -> None:
        self.spec = spec  # validated on the driver
        self.name, self.servers, self.parts, self.coordinator = name, servers, parts, coordinator
        model = initial_model(self.spec)
        self.params = dict(model.named_parameters())
        # The single-process engine's forward/backward and clipping; its optimizer stays unused.
        self.engine = single_process(self.spec, model, torch.device("cpu"))
        self.dataset = build_dataset(self.spec)
        self.order = sample_order(self.dataset, self.spec.run.seed)
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
        for p in self.params.values():
            p.grad = None
        loss = self.engine.forward_backward([self.dataset.batch(i) for i in ids])
        if self.spec.optim.grad_clip > 0:
            self.engine.clip_grad_norm(self.spec.optim.grad_clip)
        answers = ray.get([server.push.remote([self.params[n].grad for n in names], (generation, offset), version)
                           for server, names, (_, version, _) in zip(self.servers, self.parts, pulled)])
        if "refused" in answers:
            return None
        if self.ledger is not None:
            step = offset // self.spec.batch.global_batch_size + 1
            self.ledger.training(step, worker_slots(self.spec), ids, generation)
        return loss.item()
