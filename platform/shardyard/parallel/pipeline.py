"""Pipeline parallelism: a model cut into stages of consecutive blocks (by its own
`pipeline_stage` hook, models/stages.py), run by a `torch.distributed.pipelining` schedule (GPipe,
1F1B or interleaved 1F1B).

Every rank builds the whole model from the same seed (so stages start from the weights a single
process would have), then keeps only its stages' blocks. Parameter names stay those of the full
model, so pipeline checkpoints share keys with every other strategy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from shardyard.models import MetricsFn, materialise
from shardyard.models.initial_weights import InitialWeights
from shardyard.parallel.engine import Engine, MicroBatch, evaluating
from shardyard.runtime import autocast
from shardyard.spec import ParallelismSpec

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def _param_count(modules: list[nn.Module | None]) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def balanced_split(model: nn.Module, num_stages: int) -> list[int]:
    """Block indices where stages 1..S-1 begin, minimising the largest stage's parameter count
    (the first stage also holds the embeddings, the last the final norm and head)."""
    layout = model.pipeline_layout()
    blocks = [_param_count([b]) for b in layout.blocks]
    n = len(blocks)
    first, last = _param_count(layout.first), _param_count(layout.last)

    def cost(start: int, end: int) -> int:
        return sum(blocks[start:end]) + (first if start == 0 else 0) + (last if end == n else 0)

    # best[s][e]: (max stage cost, split points) for blocks[:e] in s stages; tiny n, plain DP.
    best: dict[tuple[int, int], tuple[int, list[int]]] = {(1, e): (cost(0, e), []) for e in range(1, n + 1)}
    for s in range(2, num_stages + 1):
        for e in range(s, n + 1):
            best[(s, e)] = min(
                ((max(best[(s - 1, b)][0], cost(b, e)), best[(s - 1, b)][1] + [b]) for b in range(s - 1, e)),
                key=lambda c: c[0],
            )
    return best[(num_stages, n)][1]


def stage_ids(pp_rank: int, spec: ParallelismSpec) -> list[int]:
    """Stages this rank runs: one, or (interleaved) every pp-th stage starting at its rank."""
    return [pp_rank + k * spec.pp for k in range(spec.stages_per_rank)]


class PipelineEngine(Engine):
    """Runs a whole optimizer step as one schedule: the micro-batches are the schedule's
    n_microbatches, and the schedule averages their gradients (scale_grads)."""

    def __init__(self, *args, schedule, mesh: DeviceMesh, is_first: bool, is_last: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.schedule = schedule
        self.mesh = mesh
        self.is_first, self.is_last = is_first, is_last
        # Every rank of the last stage (its dp replicas, and tp ranks holding the same loss).
        self.loss_ranks = mesh["dp"].size() * mesh["tp"].size()

    def grad_norm_group(self):
        return self.mesh["pp"].get_group()

    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        return self._run(self.schedule.step, micro_batches)

    @torch.no_grad()
    def validate(self, micro_batches: Sequence[MicroBatch], metrics: MetricsFn | None = None) -> dict[str, torch.Tensor]:
        # A language model's loss only: metrics.factory is for modules of the user's own, never pipelined.
        with evaluating(self.parts):
            return {"loss": self._run(self.schedule.eval, micro_batches)}  # the same schedule, forward only

    def _run(self, schedule_step, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        inputs = torch.cat([x for x, _ in micro_batches]).to(self.device)
        targets = torch.cat([y for _, y in micro_batches]).to(self.device)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last else {}
        with autocast(self.device, self.amp_dtype):
            schedule_step(*args, **kwargs)
        if not self.is_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).mean()


def build_stages(model: nn.Module, par: ParallelismSpec, mesh: DeviceMesh, device: torch.device,
                 weights: InitialWeights | None = None) -> tuple[list[nn.Module], list[int]]:
    points = par.split_points or balanced_split(model, par.num_stages)
    bounds = [0, *points, len(model.pipeline_layout().blocks)]
    ids = stage_ids(mesh["pp"].get_local_rank(), par)
    stages = [model.pipeline_stage(bounds[i], bounds[i + 1]) for i in ids]
    # A model built on the meta device (models.build_for_job): each rank fills only its stages.
    return [materialise(s, device, weights=weights) if any(p.is_meta for p in s.parameters()) else s.to(device)
            for s in stages], ids


def build_schedule(parts: list[nn.Module], ids: list[int], par: ParallelismSpec, mesh: DeviceMesh,
                   device: torch.device, n_microbatches: int, loss_fn) -> object:
    group = mesh["pp"].get_group()
    stages = [PipelineStage(part, i, par.num_stages, device, group=group) for part, i in zip(parts, ids)]
    cls = SCHEDULES[par.schedule]
    if par.schedule == "interleaved_1f1b":
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
