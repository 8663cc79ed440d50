"""Once per step, every rank agrees whether the run must stop or checkpoint now: a preemption
notice, a node about to be reclaimed, a lease taken over by another launch, or a loss that is
not finite; and, in an elastic group, which generation of its members trains next.

The ranks decide together (one small all-reduce of a few numbers) so that all of them take the same
branch at the same step: a rank that stopped alone would leave the others waiting in their next
collective. Rank 0 looks on a time budget, not every step: at the driver's preemption notice
(`<run>/PREEMPT`, written on SIGTERM) every `notice_every_s`, at the lease every `lease_every_s`
(a third of its ttl: a launch that lost its lease stops within one renewal period), and it says
when every rank should ask the cluster whether a worker's node is being drained
(`node_drained`, Ray Train's `get_preemption_info`, a barrier all ranks must call together)
every `drain_every_s`. In an elastic group (train/elastic_group.py) rank 0 reads the newest
generation's number every step and the all-reduce hands it to every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardyard.checkpoint.lease import LeaseLost
from shardyard.storage.store import RunStorage

log = logging.getLogger("shardyard")

PREEMPT_FILE = "PREEMPT"


class Diverged(RuntimeError):
    """The loss (or gradient norm) is not finite: nothing from this state is committed."""

    @classmethod
    def at(cls, step: int, what: str, can_skip: bool) -> Diverged:
        """`what` (the loss, the weights, ...) is not finite at `step`, with what to do about it
        (`can_skip`: run.on_nonfinite: skip would pass over such steps)."""
        remedy = "Lower optim.lr, set optim.grad_clip" + (
            ", or set run.on_nonfinite: skip to pass over such steps" if can_skip else "")
        return cls(f"{what} not finite at step {step} (run.on_nonfinite: stop): nothing from this state "
                   f"was committed. {remedy}")


@dataclass
class Verdict:
    preempt: bool = False         # stop after a checkpoint at this step (SIGTERM to the driver)
    lease_lost: str | None = None
    nonfinite: bool = False
    drained: bool | None = None   # a worker's node is being drained (None: not asked at this step)
    generation: int | None = None  # an elastic group's newest generation (None: a fixed group)


class StepGuard:
    def __init__(self, run_uri: str, rank: int, device: torch.device, fence: Callable[[], None] | None,
                 lease_every_s: float, node_drained: Callable[[], bool] | None = None,
                 notice_every_s: float = 1.0, drain_every_s: float = 5.0,
                 newest_generation: Callable[[], int] | None = None) -> None:
        self.storage = RunStorage(run_uri)
        self.newest_generation = newest_generation
        self.rank, self.device, self.fence, self.node_drained = rank, device, fence, node_drained
        self.lease_every_s, self.notice_every_s, self.drain_every_s = lease_every_s, notice_every_s, drain_every_s
        self._next_lease = self._next_notice = self._next_drain = time.monotonic()
        self._lost: str | None = None

    def _drain_due(self) -> bool:
        now = time.monotonic()
        if self.node_drained is None or now < self._next_drain:
            return False
        self._next_drain = now + self.drain_every_s
        return True

    def _rank0_flags(self) -> tuple[bool, bool]:
        now = time.monotonic()
        preempt = False
        if now >= self._next_notice:
            self._next_notice = now + self.notice_every_s
            preempt = self.storage.exists(PREEMPT_FILE)
        if self.fence is not None and self._lost is None and now >= self._next_lease:
            self._next_lease = now + self.lease_every_s
            try:
                self.fence()
            except LeaseLost as err:
                self._lost = str(err)
            except OSError as err:  # storage unreachable for now: asked again next period
                log.warning("cannot read the run's lease (%s); checking again in %.0f s", err, self.lease_every_s)
        return preempt, self._lost is not None

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> Verdict:
        """Collective: the verdict of every rank on the step just run (`loss`: this rank's;
        `grad_norm`: the step's gradient norm, where the engine measured one)."""
        preempt, lost = self._rank0_flags() if self.rank == 0 else (False, False)
        ask_cluster = self.rank == 0 and self._drain_due()
        generation = self.newest_generation() if self.rank == 0 and self.newest_generation is not None else 0
        # Float32 holds every generation number below 2**24 exactly.
        flags = torch.tensor([float(preempt), float(lost), 0.0, float(ask_cluster), float(generation)],
                             device=self.device)
        finite = torch.isfinite(loss.detach().float())
        if grad_norm is not None:
            finite &= torch.isfinite(grad_norm.detach().float().to(self.device))
        flags[2] = (~finite).float()
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        *agreed, newest = flags.tolist()
        preempt_all, lost_all, nonfinite, ask_all = (bool(v) for v in agreed)
        reason = (self._lost or "this launch's lease was taken over by another launch") if lost_all else None
        drained = self.node_drained() if ask_all and self.node_drained is not None else None  # all ranks at once
        return Verdict(preempt=preempt_all, lease_lost=reason, nonfinite=nonfinite, drained=drained,
                       generation=int(newest) if self.newest_generation is not None else None)
