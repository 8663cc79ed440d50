"""torch.compile, one repeated block at a time (as TorchTitan does): each block's graph is fused
by Inductor while the blocks stay separate modules, so FSDP2 still gathers and frees one block at
a time, DDP's hooks still see every parameter, and parameter names (checkpoints) do not change.
The blocks of one model share their compiled code (same class and shapes), so compiling costs one
block's time, paid on the first step."""

from __future__ import annotations

from torch import nn

from shardyard.models import repeated_blocks


def apply_compile(model: nn.Module) -> None:
    """Compile each block of `model` in place (after tensor parallelism and activation
    checkpointing, before the data-parallel wrapper)."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"parallelism.compile compiles the model's repeated blocks: "
                         f"{type(model).__name__} names none in `_no_split_modules`")
    for parent, name in blocks:
        getattr(parent, name).compile()
