"""FSDP2: parameters, gradients and optimizer state sharded over the dp mesh dimension.

`fully_shard` is applied per repeated block (the model's `_no_split_modules`: GPT blocks, a
Hugging Face model's decoder layers) and once at the root for the rest.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from shardyard.models import repeated_blocks
from shardyard.parallel.engine import Engine
from shardyard.spec import ParallelismSpec


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"parallelism.activation_checkpointing needs the model's repeated blocks: "
                         f"{type(model).__name__} names none in `_no_split_modules`")
    for parent, name in blocks:
        setattr(parent, name, checkpoint_wrapper(getattr(parent, name)))


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
    # Each block gathered just before it runs and freed after; a model that names no blocks is
    # sharded at the root alone (whole-model gathers: correct, with less memory saved).
    for parent, name in repeated_blocks(model):
        fully_shard(getattr(parent, name), **kwargs)
    return fully_shard(model, **kwargs)


class FSDPEngine(Engine):
    def accumulating(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Reduce-scatter gradients only on the last micro-step; earlier ones accumulate unsharded.
        self.model.set_requires_gradient_sync(is_last_micro_step)
        return contextlib.nullcontext()
