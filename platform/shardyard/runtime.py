"""Device, process-group backend and precision, chosen from what the machine has."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch


def select_device(local_rank: int = 0, use_cuda: bool = True) -> torch.device:
    """One CUDA device per worker when CUDA is visible (and `use_cuda`: a worker placed on CPU
    beside GPUs still sees them, as Ray leaves CUDA_VISIBLE_DEVICES alone), the CPU otherwise."""
    if use_cuda and torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU by default; CPU trains in fp32 (CPU bf16 matmuls are slow and lossy).
    float8 computes in bf16 around its float8 matmuls."""
    if precision in ("bf16", "float8") or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
    else:
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield


def import_deepspeed() -> ModuleType:
    """DeepSpeed, on the accelerator this machine has: DeepSpeed picks its accelerator once, at its
    first import in the process, and on a machine without CUDA wants the CPU one named (gloo,
    torch's Adam). Every use of DeepSpeed comes through here, so none imports it unprepared."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed

    return deepspeed
