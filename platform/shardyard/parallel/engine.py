"""The one interface every parallel strategy implements: an optimizer step over micro-batches.

The training loop knows only this class. A strategy wraps the model its own way and overrides
the hooks that differ: how accumulation skips communication, how a step runs (a pipeline runs a
schedule), and which ranks feed data and hold the loss.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from shardyard.models import LossFn, MetricsFn
from shardyard.optim import Schedule
from shardyard.runtime import autocast

# (the model's input, what the loss reads with its output): tensors for the built-in data, any
# nesting of tensors in tuples, lists and dicts for a dataset of the user's own.
MicroBatch = tuple[Any, Any]


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device` (a copy that may overlap the next work)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


class Engine:
    """Holds the model (one part, or several pipeline chunks), one optimizer and LR schedule per
    part, and runs the training step."""

    # Which round of a changing replica group runs this step (hot recovery: the TorchFT quorum);
    # None where the group is fixed. The sample ledger keys its lines by it.
    step_round: int | None = None
    # run.on_nonfinite: skip. A step whose loss or gradient norm is not finite on any rank is not
    # applied (`skipped`); the ZeRO and hot-recovery engines do not offer it (the spec refuses).
    skip_nonfinite = False
    skipped = False
    grad_norm: torch.Tensor | None = None  # the last step's global gradient norm, where it was measured
    checkpoint_format = "dcp"  # how the checkpoint manager stores this engine's state (checkpoint/)
    # Every rank holds the whole model and optimizer state (DDP): one that survives the others
    # can hand the state over alone.
    whole_replicas = False

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 schedulers: list[torch.optim.lr_scheduler.LRScheduler], loss_fn: LossFn,
                 grad_clip: float, device: torch.device, amp_dtype: torch.dtype | None,
                 dp_rank: int = 0, dp_size: int = 1, data_owner: bool = True) -> None:
        self.parts = parts
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.loss_fn = loss_fn
        self.grad_clip = grad_clip
        self.device = device
        self.amp_dtype = amp_dtype
        self.dp_rank = dp_rank  # which slice of each global batch this rank reads
        self.dp_size = dp_size
        # One rank per data-parallel replica speaks for its samples (tp and pp ranks share them).
        self.data_owner = data_owner
        # Ranks whose returned loss is real (a pipeline's last stage); the loop averages over them.
        self.loss_ranks = dist.get_world_size() if dist.is_initialized() else 1

    @property
    def model(self) -> nn.Module:
        return self.parts[0]

    @property
    def module(self) -> nn.Module:
        """The user's model without any wrapper, for exporting and inspection."""
        return self.model

    def checkpointed(self) -> dict[str, Stateful]:
        """What a checkpoint holds of this engine beside the model and optimizer state (which
        the engine's checkpoint format writes), by the key it is stored under."""
        return {"scheduler": Schedule(self.schedulers)}

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def begin_step(self, state: object) -> None:
        """Called before each step's data is chosen (replicas agree on a quorum here, and one
        that is behind may replace `state` with a live peer's)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights in rank 0's memory (the other ranks get {}); every rank calls
        it: an all-gather of FSDP's or tensor parallelism's shards, DDP's replica as it is."""
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def close(self) -> None:
        """Release what the engine holds beyond the process group."""

    def accumulating(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward; strategies skip syncs in it."""
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        """Accumulate the gradient of the mean loss over this rank's micro-batches.

        Each micro-loss is divided by the number of micro-steps; the strategy's reduction then
        averages over data-parallel ranks: the gradient of the mean over the global batch.
        """
        steps = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.accumulating(i == steps - 1):
                with autocast(self.device, self.amp_dtype):
                    outputs = self.model(to_device(inputs, self.device))
                loss = self.loss_fn(outputs, to_device(targets, self.device)) / steps
                loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def validate(self, micro_batches: Sequence[MicroBatch], metrics: MetricsFn | None = None) -> dict[str, torch.Tensor]:
        """This rank's mean loss (and `metrics`' values) over its micro-batches of one global batch,
        in eval mode (no dropout) and without gradients. Zero where the rank holds no loss."""
        totals: dict[str, torch.Tensor] = {}
        with evaluating(self.parts):
            for inputs, targets in micro_batches:
                with autocast(self.device, self.amp_dtype):
                    outputs = self.model(to_device(inputs, self.device))
                targets = to_device(targets, self.device)
                values = {"loss": self.loss_fn(outputs, targets), **measured(metrics, outputs, targets)}
                for name, value in values.items():
                    share = torch.as_tensor(value, dtype=torch.float32, device=self.device) / len(micro_batches)
                    totals[name] = totals.get(name, 0) + share
        return totals

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        """One optimizer step; returns this rank's mean loss (zero where it holds none)."""
        loss = self.forward_backward(micro_batches)
        # Measured every step (a reduction of one number per mesh), for the metrics and the step
        # guard; an infinite bound only measures it.
        norm = self.clip_grad_norm(self.grad_clip if self.grad_clip > 0 else math.inf)
        self.grad_norm = norm
        self.skipped = self.skip_nonfinite and not self._finite_everywhere(loss, norm)
        if self.skipped:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            return loss
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        return loss

    @staticmethod
    def _finite_everywhere(loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """Collective: whether every rank's loss and the gradient norm are finite."""
        bad = (~torch.isfinite(loss.detach().float()) | ~torch.isfinite(norm.float())).float()
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def grad_norm_group(self) -> dist.ProcessGroup | None:
        """Ranks whose gradients are disjoint pieces of one model (pipeline stages)."""
        return None

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over the whole model, wherever its pieces live, with torch's own
        functions: the local norms of sharded (DTensor) gradients become one total in a single
        reduction per mesh and placement (not per parameter), and pipeline stages add theirs in
        one all-reduce."""
        # One norm per kind of gradient: DTensors of one mesh and placement reduce together (a
        # model mixing tensor-parallel blocks with data-parallel-only embeddings has a few kinds).
        kinds: dict[object, list[nn.Parameter]] = {}
        for p in (p for p in self.parameters() if p.grad is not None):
            kind = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            kinds.setdefault(kind, []).append(p)
        norms = []
        for same_kind in kinds.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in same_kind], foreach=True)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        group = self.grad_norm_group()
        if group is not None:
            total = total ** 2
            dist.all_reduce(total, group=group)
            total = total.sqrt()
        if math.isfinite(max_norm):
            for same_kind in kinds.values():  # DTensors of different meshes cannot be scaled in one call
                torch.nn.utils.clip_grads_with_norm_(same_kind, max_norm, total, foreach=True)
        return total


def measured(metrics: MetricsFn | None, outputs: Any, batch: Any) -> Mapping[str, Any]:
    """The user's metrics of one validation batch, checked: a mapping of names to scalars."""
    if metrics is None:
        return {}
    values = metrics(outputs, batch)
    if not isinstance(values, Mapping) or "loss" in values:
        raise TypeError(f"metrics.factory's function returned {type(values).__name__}: it must return a dict of "
                        f"names (other than 'loss', which val_loss reports) to scalars")
    return values


@contextlib.contextmanager
def evaluating(parts: Sequence[nn.Module]):
    """Eval mode for the duration, then training mode again."""
    for part in parts:
        part.eval()
    try:
        yield
    finally:
        for part in parts:
            part.train()
