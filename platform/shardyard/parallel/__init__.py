"""Parallel strategies, each behind the `Engine` interface, chosen by `parallelism.strategy`.

A new strategy is one module that wraps the model and returns an Engine, plus one registry line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardyard.models import loss_fn_for
from shardyard.parallel.ddp import DDPEngine, apply_ddp
from shardyard.parallel.engine import Engine, MicroBatch
from shardyard.runtime import autocast_dtype
from shardyard.spec import JobSpec
from shardyard.train.optim import build_optimizer, build_scheduler

EngineBuilder = Callable[[JobSpec, nn.Module, torch.device], Engine]


def _engine(cls: type[Engine], spec: JobSpec, model: nn.Module, device: torch.device) -> Engine:
    optimizer = build_optimizer(model.parameters(), spec.optim)
    return cls(model, optimizer, build_scheduler(optimizer, spec.optim, spec.run.steps),
               loss_fn_for(spec.model), spec.optim.grad_clip, device,
               autocast_dtype(spec.run.precision, device))


def single_process(spec: JobSpec, model: nn.Module, device: torch.device) -> Engine:
    """No parallelism: the reference every strategy is tested against."""
    return _engine(Engine, spec, model.to(device), device)


def ddp(spec: JobSpec, model: nn.Module, device: torch.device) -> Engine:
    return _engine(DDPEngine, spec, apply_ddp(model.to(device), device), device)


STRATEGIES: dict[str, EngineBuilder] = {"ddp": ddp}


def build_engine(spec: JobSpec, model: nn.Module, device: torch.device) -> Engine:
    """Wrap `model` for the spec's strategy. Call inside an initialised process group."""
    return STRATEGIES[spec.parallelism.strategy](spec, model, device)


__all__ = ["Engine", "MicroBatch", "STRATEGIES", "build_engine", "single_process"]
