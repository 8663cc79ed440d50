"""Optimizer and learning-rate schedule (linear warmup, then cosine decay to a floor)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from shardyard.spec import OptimSpec


def build_optimizer(params: Iterable[torch.nn.Parameter], spec: OptimSpec) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)


def lr_factor(step: int, spec: OptimSpec, total_steps: int) -> float:
    """Multiplier on `spec.lr` for the optimizer step with index `step` (0-based)."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, spec: OptimSpec, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, spec, total_steps))
