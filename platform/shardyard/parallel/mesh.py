"""The (pp, dp, tp) DeviceMesh every strategy is applied over."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardyard.spec import ParallelismSpec


def build_mesh(spec: ParallelismSpec, world_size: int, device: torch.device) -> DeviceMesh:
    """tp innermost: its ranks talk every layer, so they should be neighbours (same node)."""
    dp = spec.dp_size(world_size)
    return init_device_mesh(device.type, (spec.pp, dp, spec.tp), mesh_dim_names=("pp", "dp", "tp"))
