"""Optimizer and learning-rate schedule (linear warmup, then cosine decay to a floor)."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from shardyard.spec import OptimSpec


def decayed(model: nn.Module) -> dict[str, bool]:
    """Which parameters get weight decay, as nanoGPT's configure_optimizers decides: the matrices
    of linear layers do; biases, norms' gains and embeddings do not (shrinking them toward zero
    only hurts). A tied weight is decided by the embedding it is. Each tied parameter once."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {name: p.dim() >= 2 and id(p) not in embeddings for name, p in model.named_parameters()}


def decay_groups(params: dict[str, nn.Parameter], decays: dict[str, bool], weight_decay: float) -> list[dict]:
    """The parameter groups with and without weight decay; one group when there is no decay to
    apply (an empty or needless group is left out: DeepSpeed 0.19's universal checkpoint and
    tensor-fragment API mis-handle ZeRO optimizers of several groups, see README)."""
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    if weight_decay == 0:
        return [{"params": list(trainable.values()), "weight_decay": 0.0}]
    groups = [{"params": [p for n, p in trainable.items() if decays[n]], "weight_decay": weight_decay},
              {"params": [p for n, p in trainable.items() if not decays[n]], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, spec: OptimSpec) -> torch.optim.Optimizer:
    return optimizer_over(decay_groups(dict(model.named_parameters()), decayed(model), spec.weight_decay), spec)


def optimizer_over(groups: list[dict], spec: OptimSpec) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum)
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas)


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


class Schedule:
    """An engine's learning-rate schedules (one per optimizer, all at the same step) as one object
    a checkpoint saves and restores (torch.distributed.checkpoint's Stateful protocol): saved as
    LambdaLR saves itself; restored, each resumes at the stored step with its own base rates, so a
    run launched again with another optim.lr trains at that rate from the step it resumes."""

    def __init__(self, schedulers: list[LambdaLR]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, stored: dict) -> None:
        for scheduler in self.schedulers:
            base_lrs = list(scheduler.base_lrs)  # the stored rates would silently override a changed optim.lr
            scheduler.load_state_dict(stored)
            scheduler.base_lrs = base_lrs
            # A schedule sets the learning rate only when it steps; the step about to run needs the
            # resumed one now (formats that do not carry the optimizer's settings, and
            # `load_optimizer: false`, would otherwise train one step at the stored rate).
            for group, base, factor in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
                group["lr"] = base * factor(scheduler.last_epoch)

    def resume_at(self, step: int) -> None:
        """Every schedule as a synchronous run's is after `step` optimizer steps (the parameter
        servers' cut: the servers' updates are not steps of these schedules)."""
        for scheduler in self.schedulers:
            scheduler.last_epoch = step - 1
            with warnings.catch_warnings():  # "scheduler stepped before the optimizer": meant here
                warnings.simplefilter("ignore", UserWarning)
                scheduler.step()
