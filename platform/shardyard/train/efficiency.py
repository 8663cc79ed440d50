"""How well a run uses its hardware: the model FLOPs a token costs to train, the FLOP/s achieved,
model FLOPs utilization (MFU) against the devices' peak where it is known, and peak memory.

Model FLOPs per token follow PaLM's accounting (Chowdhery et al. 2022, appendix B): 6 per
parameter (a multiply and an add, forward and twice backward) plus the attention scores,
12 x layers x width x context. Recomputation (activation checkpointing) is not counted: it is
hardware work, not model work. MFU divides by the devices' dense bf16 peak, the figure MFU is
quoted against; on CPUs there is no such figure, so no MFU is reported unless the user gives the
peak (`run.peak_tflops`, also for GPUs the table does not list). A module of the user's own is
counted by torch's FLOP counter instead (module_flops_per_sample).
"""

from __future__ import annotations

import resource
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

from shardyard.data.user_dataset import UserDataset, UserStream
from shardyard.models import build_model
from shardyard.parallel.engine import to_device
from shardyard.spec import ModuleSpec

# Dense bf16 tensor-core peak, FLOP/s, by the name CUDA reports (the first match wins).
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12),
             ("L4", 121e12), ("A10", 125e12), ("V100", 125e12), ("T4", 65e12))


def flops_per_token(parameters: int, layers: int, width: int, context: int) -> float:
    """Model FLOPs to train on one token (forward and backward)."""
    return 6.0 * parameters + 12.0 * layers * width * context


def module_flops_per_sample(spec: ModuleSpec, dataset: UserDataset | UserStream) -> float | None:
    """Model FLOPs to train on one sample of a module of the user's own, where no formula knows
    its layers: torch's FlopCounterMode counts a forward of one sample, run on the meta device
    (shapes only), and training is three forwards' worth (the backward computes two gradients).
    None where the forward cannot run on shapes alone (it reads a value: `.item()`, data-dependent
    control flow): the run then reports no FLOP/s or MFU rather than a wrong one."""
    with torch.device("meta"):
        model = build_model(spec)
    inputs, _ = dataset.first_batch()
    try:
        with FlopCounterMode(display=False) as counter:
            model(to_device(inputs, torch.device("meta")))
    except Exception:  # noqa: BLE001 - the user's forward; any failure means: not countable this way
        return None
    return 3.0 * counter.get_total_flops()


def device_peak_flops(device: torch.device, given_tflops: float | None = None) -> float | None:
    """The device's dense bf16 peak: as the user gave it (run.peak_tflops), else from the table;
    None where it is not known (CPUs, unlisted GPUs)."""
    if given_tflops is not None:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: on a GPU, what torch allocated there; on a CPU, the
    process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
