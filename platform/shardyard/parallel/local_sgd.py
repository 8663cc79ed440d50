"""Local SGD: every rank trains its own copy on its own share of each global batch, and the copies
are averaged (one all-reduce of the parameters) every `sync_every` steps instead of averaging
gradients every step. Communication drops H-fold; the copies drift apart in between.

With plain SGD (momentum and weight decay included: all linear in the gradient) and no gradient
clipping, H = 1 gives exactly synchronous data parallelism: the mean of the ranks' updates is the
update of the mean gradient. Adam's per-rank normalisation makes it an approximation. Each rank
keeps its own optimizer state; a checkpoint (always right after an average) stores rank 0's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from shardyard.models import LossFn
from shardyard.parallel.engine import Engine, MicroBatch


class LocalSGDEngine(Engine):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loss_fn: LossFn, grad_clip: float,
                 device: torch.device, amp_dtype: torch.dtype | None, sync_every: int) -> None:
        # Same seed on every rank: the copies start equal, as after an average.
        super().__init__([model], [optimizer], [scheduler], loss_fn, grad_clip, device, amp_dtype,
                         dp_rank=dist.get_rank(), dp_size=dist.get_world_size())
        self.sync_every = sync_every
        self.next_step = 1  # the step train_step runs, numbered from 1 as the loop counts

    def begin_step(self, state: object) -> None:
        self.next_step = state.step + 1  # resumed runs average on the same steps as straight ones

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        loss = super().train_step(micro_batches)  # a purely local optimizer step
        if self.next_step % self.sync_every == 0:
            average_parameters(iter(self.model.parameters()), dist.group.WORLD)
        self.next_step += 1
        return loss
