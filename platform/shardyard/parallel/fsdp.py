"""FSDP2: parameters, gradients and optimizer state sharded over the dp mesh dimension.

`fully_shard` is applied per transformer block (each block's parameters are gathered just
before it runs and freed after) and once at the root for the rest.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from shardyard.parallel.engine import Engine
from shardyard.spec import ParallelismSpec


def block_container(model: nn.Module) -> nn.ModuleDict:
    """The ModuleDict of repeated blocks (GPT blocks, MLP layers)."""
    return model.blocks if hasattr(model, "blocks") else model.layers


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them."""
    blocks = block_container(model)
    for name, block in list(blocks.items()):
        blocks[name] = checkpoint_wrapper(block)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, spec: ParallelismSpec,
               device: torch.device) -> nn.Module:
    kwargs: dict = {"mesh": dp_mesh}
    if spec.mixed_precision and device.type == "cuda":
        # bf16 compute and all-gathers, fp32 gradient reduction for accuracy.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if spec.cpu_offload and device.type == "cuda":
        # Parameters, gradients and optimizer state in host memory between uses. On a CPU-only
        # device they already live there (and FSDP's policy requires an accelerator).
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in block_container(model).values():
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


class FSDPEngine(Engine):
    def accumulating(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Reduce-scatter gradients only on the last micro-step; earlier ones accumulate unsharded.
        self.model.set_requires_gradient_sync(is_last_micro_step)
        return contextlib.nullcontext()
