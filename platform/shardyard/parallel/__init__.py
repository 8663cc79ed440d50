"""Parallel strategies behind one `Engine` interface, chosen by the job spec's `parallelism`.

`build_engine` lays the (pp, dp, tp) mesh, then applies each part as one small function:
pipeline stages (pipeline.py), tensor parallelism (tensor.py), then the data-parallel flavour:
DDP (ddp.py), FSDP2 (fsdp.py), DeepSpeed ZeRO (zero.py) or periodic parameter averaging
(local_sgd.py). Hot recovery replaces DDP with replicas that survive each other's failures
(fault_tolerant_ddp.py). `parallelism.compile` compiles each block in between (compile.py).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from shardyard.models import loss_fn_for, materialise
from shardyard.models.initial_weights import InitialWeights
from shardyard.parallel.compile import apply_compile
from shardyard.parallel.ddp import DDPEngine, apply_ddp
from shardyard.parallel.engine import Engine, MicroBatch
from shardyard.parallel.float8 import apply_float8, float8_unsupported
from shardyard.parallel.fsdp import FSDPEngine, apply_activation_checkpointing, apply_fsdp
from shardyard.parallel.local_sgd import LocalSGDEngine
from shardyard.parallel.mesh import build_mesh
from shardyard.parallel.pipeline import PipelineEngine, build_schedule, build_stages
from shardyard.parallel.tensor import apply_tensor_parallel
from shardyard.layout.world_size import grad_accum_steps
from shardyard.runtime import autocast_dtype
from shardyard.spec import ZERO_STAGES, JobSpec
from shardyard.optim import build_optimizer, build_scheduler


def _optimizers(spec: JobSpec, parts: list[nn.Module]) -> tuple[list, list]:
    optimizers = [build_optimizer(part, spec.optim) for part in parts]
    return optimizers, [build_scheduler(o, spec.optim, spec.run.steps) for o in optimizers]


def single_process(spec: JobSpec, model: nn.Module, device: torch.device) -> Engine:
    """No parallelism: the reference every strategy is tested against."""
    optimizers, schedulers = _optimizers(spec, [model.to(device)])
    return Engine([model], optimizers, schedulers, loss_fn_for(spec), spec.optim.grad_clip,
                  device, autocast_dtype(spec.run.precision, device))


def build_engine(spec: JobSpec, model: nn.Module, device: torch.device, replica_id: str = "",
                 weights: InitialWeights | None = None) -> Engine:
    """Wrap `model` for the spec's parallelism. Call inside an initialised process group, with
    the same seed on every rank so every rank starts from the same weights. `replica_id` names
    this worker to its peers under hot recovery. `weights`: what a model built on the meta device
    (models.build_for_job) is filled with once split (a model directory's), instead of drawn ones."""
    par, world = spec.parallelism, dist.get_world_size()
    loss_fn, accum = loss_fn_for(spec), grad_accum_steps(spec, world)
    amp = autocast_dtype(spec.run.precision, device)
    on_meta = any(p.is_meta for p in model.parameters())  # see models.build_for_job
    if spec.run.precision == "float8":  # the spec allows it under ddp, fsdp and local_sgd only
        if (reason := float8_unsupported(device)) is not None:
            raise ValueError(reason)
        apply_float8(model)

    if par.compile and (spec.scaling.recovery == "hot" or par.strategy == "local_sgd"):
        apply_compile(model)  # whole-model replicas: no wrapper between the blocks and the engine
    if spec.scaling.recovery == "hot":
        from shardyard.parallel.fault_tolerant_ddp import FaultTolerantDDPEngine  # imports torchft

        optimizers, schedulers = _optimizers(spec, [model.to(device)])
        return FaultTolerantDDPEngine(model, optimizers[0], schedulers[0], loss_fn, spec.optim.grad_clip,
                                      device, amp, replica_id=replica_id)

    if par.strategy == "local_sgd":
        optimizers, schedulers = _optimizers(spec, [model.to(device)])
        return LocalSGDEngine(model, optimizers[0], schedulers[0], loss_fn, spec.optim.grad_clip, device, amp,
                              sync_every=par.sync_every)

    if par.strategy in ZERO_STAGES:
        from shardyard.parallel import zero  # imports DeepSpeed: only when asked for

        zero.start(device)
        if on_meta:  # ZeRO-3: see models.build_for_job
            model = zero.build_partitioned(spec, model, accum, device, weights)
        optimizers, schedulers = _optimizers(spec, [model.to(device)])
        ds = zero.initialize(model, optimizers[0], schedulers[0], spec, accum, device)
        # DeepSpeed casts to bf16 itself on GPU, so no autocast on top.
        return zero.ZeroEngine([ds], optimizers, schedulers, loss_fn, spec.optim.grad_clip, device,
                               None, dp_rank=dist.get_rank(), dp_size=world)

    mesh = build_mesh(par, world, device)
    dp_mesh = mesh["dp"]
    common = dict(loss_fn=loss_fn, grad_clip=spec.optim.grad_clip, device=device, amp_dtype=amp,
                  dp_rank=dp_mesh.get_local_rank(), dp_size=dp_mesh.size(),
                  data_owner=mesh["pp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0)

    if par.pp > 1:
        parts, ids = build_stages(model, par, mesh, device, weights)
        parts = [_data_parallel(_tensor_parallel(part, par, mesh), par, dp_mesh, device) for part in parts]
        schedule = build_schedule(parts, ids, par, mesh, device, accum, loss_fn)
        optimizers, schedulers = _optimizers(spec, parts)
        return PipelineEngine(parts, optimizers, schedulers, schedule=schedule, mesh=mesh,
                              is_first=0 in ids, is_last=par.num_stages - 1 in ids, **common)

    shapes = copy.deepcopy(model) if on_meta else None  # the model unsharded, to draw units from
    model = _data_parallel(_tensor_parallel(model if on_meta else model.to(device), par, mesh), par, dp_mesh,
                           device)
    if on_meta:  # sharded while empty: now each rank allocates and fills only its shards
        materialise(model, device, shapes, weights)
    if par.strategy == "fsdp" and par.mixed_precision and device.type == "cuda":
        common["amp_dtype"] = None  # FSDP's policy already computes in bf16
    # tensor: every rank holds a slice of every block; nothing else to synchronise.
    cls = {"fsdp": FSDPEngine, "ddp": DDPEngine}.get(par.strategy, Engine)
    optimizers, schedulers = _optimizers(spec, [model])
    return cls([model], optimizers, schedulers, **common)


def _tensor_parallel(model: nn.Module, par, mesh) -> nn.Module:
    return apply_tensor_parallel(model, mesh["tp"]) if par.tp > 1 else model


def _data_parallel(model: nn.Module, par, dp_mesh, device: torch.device) -> nn.Module:
    """The data-parallel wrapper over the dp mesh dimension: FSDP2 shards, DDP replicates; each
    block is compiled first, when asked (after activation checkpointing wraps it)."""
    if par.strategy == "fsdp" and par.activation_checkpointing:
        apply_activation_checkpointing(model)
    if par.compile:
        apply_compile(model)
    if par.strategy == "fsdp":
        return apply_fsdp(model, dp_mesh, par, device)
    if dp_mesh.size() > 1 or par.strategy == "ddp":
        return apply_ddp(model, device, dp_mesh.get_group())
    return model


__all__ = ["Engine", "MicroBatch", "build_engine", "single_process"]
