"""What torch.distributed.checkpoint (DCP) can store of a sharded tensor, and reading into one it
cannot. DCP cannot write a strided shard (tensor parallelism's packed gate and up projections: its
chunks of a tensor are not contiguous), so such tensors are stored as plain shards of the same
dimension (`dcp_layout`), and what DCP reads into those is copied back into the tensor's own
layout (`through_stand_ins`). Checkpoints (checkpoint/dcp_io.py) and a model directory's
safetensors read by each rank (models/hf.py) both go through it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def _dcp_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A strided shard that no later mesh dimension refines becomes a plain shard of its
    dimension (FSDP's own strided shard over tensor-parallel slices is one DCP can write)."""
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) and not any(
        isinstance(q, Shard) and q.dim == p.dim for q in placements[i + 1:]) else p
        for i, p in enumerate(placements))


def dcp_layout(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each tensor DCP cannot describe (a packed parameter, or its optimizer state)
    redistributed as a plain shard of the same dimension; everything else as it was."""
    def storable(value: Any) -> Any:
        if isinstance(value, DTensor) and (plain := _dcp_placements(value.placements)) != value.placements:
            return value.redistribute(placements=plain)
        return value

    return {key: storable(value) for key, value in state.items()}


@contextmanager
def through_stand_ins(state: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`state` as DCP can read into it: the block reads into what it is given (`dcp.load`); then
    each stand-in's values are copied into the tensor it stood in for, and values DCP replaced
    (not tensors: an optimizer's step count, its settings) are taken into `state`."""
    read = dcp_layout(state)
    stand_ins = [key for key, value in state.items() if read[key] is not value]
    yield read
    with torch.no_grad():
        for key in stand_ins:
            state[key].copy_(read[key].redistribute(placements=state[key].placements))
    state.update({key: value for key, value in read.items() if key not in stand_ins})
