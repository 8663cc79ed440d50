"""DDP: every rank holds the whole model; gradients are all-reduced (averaged) once per step."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardyard.parallel.engine import Engine


def apply_ddp(model: nn.Module, device: torch.device,
              group: dist.ProcessGroup | None = None) -> DistributedDataParallel:
    """Wrap `model` (already on `device`) for data parallelism over `group` (default: all ranks).
    DDP broadcasts the group's first rank's parameters at construction."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group)


class DDPEngine(Engine):
    whole_replicas = True

    @property
    def module(self) -> nn.Module:
        return self.model.module

    def accumulating(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Only the last micro-step's backward all-reduces; the others accumulate locally.
        return contextlib.nullcontext() if is_last_micro_step else self.model.no_sync()
