"""float8 training (`run.precision: float8`): torchao swaps each block's linear layers for ones
whose matmuls run in float8 with dynamic per-tensor scales (bf16 everywhere else, fp32 master
weights), as TorchTitan does. The output head and linears whose dimensions are not multiples of
16 (what the float8 matmul kernels take) stay bf16.

Only on GPUs with float8 tensor cores (compute capability 8.9 and later: Ada, Hopper, Blackwell);
torch's CPU float8 matmul exists but is slower than fp32 here, so the spec's own checks and the
launch refuse it elsewhere, naming the reason."""

from __future__ import annotations

import torch
from torch import nn

from shardyard.models import repeated_blocks

FLOAT8_CAPABILITY = (8, 9)
KERNEL_MULTIPLE = 16


def float8_unsupported(device: torch.device) -> str | None:
    """Why float8 training cannot run on `device`; None where it can."""
    if device.type != "cuda":
        return (f"run.precision float8 needs a GPU of compute capability 8.9 or later; this worker trains on "
                f"{device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        return (f"run.precision float8 needs a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: use run.precision bf16")
    return None


def float8_linears(model: nn.Module) -> list[str]:
    """The names of the linear layers float8 converts: inside the model's repeated blocks, with
    both dimensions multiples of 16."""
    blocks = {id(getattr(parent, name)) for parent, name in repeated_blocks(model)}
    inside: set[str] = set()
    for prefix, module in model.named_modules():
        if id(module) in blocks:
            inside.update(f"{prefix}.{sub}" if sub else prefix for sub, _ in module.named_modules())
    return [name for name, module in model.named_modules()
            if name in inside and type(module) is nn.Linear
            and module.in_features % KERNEL_MULTIPLE == 0 and module.out_features % KERNEL_MULTIPLE == 0]


def apply_float8(model: nn.Module) -> list[str]:
    """Convert `model`'s block linears to float8 training in place (before tensor parallelism,
    compile and the data-parallel wrapper); returns the converted layers' names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # an extra: shardyard[float8]

    chosen = set(float8_linears(model))
    if not chosen:
        raise ValueError(f"run.precision float8 converts the linear layers of the model's repeated blocks: "
                         f"{type(model).__name__} has none whose dimensions are multiples of {KERNEL_MULTIPLE}")
    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=lambda _, fqn: fqn in chosen)
    return sorted(chosen)
