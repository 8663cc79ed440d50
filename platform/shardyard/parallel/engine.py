"""The one interface every parallel strategy implements: an optimizer step over micro-batches.

The training loop knows only this class; each strategy module wraps the model its own way and
overrides the hooks that differ (how accumulation skips communication, what `module` to export).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from shardyard.models import LossFn
from shardyard.runtime import autocast

MicroBatch = tuple[torch.Tensor, torch.Tensor]


class Engine:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loss_fn: LossFn,
                 grad_clip: float, device: torch.device, amp_dtype: torch.dtype | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.grad_clip = grad_clip
        self.device = device
        self.amp_dtype = amp_dtype

    @property
    def module(self) -> nn.Module:
        """The user's model without any wrapper, for exporting and inspection."""
        return self.model

    def accumulating(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward; strategies skip syncs in it."""
        return contextlib.nullcontext()

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        """Forward/backward every micro-batch, then one optimizer step.

        Each micro-loss is divided by the number of micro-steps, so the accumulated gradient is
        the gradient of the mean loss over this rank's samples; the strategy's reduction then
        averages over ranks, giving the gradient of the mean over the global batch.
        Returns this rank's mean loss (detached).
        """
        steps = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.accumulating(i == steps - 1):
                with autocast(self.device, self.amp_dtype):
                    outputs = self.model(inputs.to(self.device, non_blocking=True))
                loss = self.loss_fn(outputs, targets.to(self.device, non_blocking=True)) / steps
                loss.backward()
            total += loss.detach()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total
