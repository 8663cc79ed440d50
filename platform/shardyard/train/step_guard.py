"""Once per step, every rank agrees whether the run must stop: a preemption notice, a lease taken
over by another launch, or a loss that is not finite.

The ranks decide together (one small all-reduce of three flags) so that all of them take the same
branch at the same step: a rank that stopped alone would leave the others waiting in their next
collective. Rank 0 looks at storage on a time budget, not every step: the preemption notice
(`<run>/PREEMPT`, written by the driver on SIGTERM) every `notice_every_s`, the lease every
`lease_every_s` (a third of its ttl: a launch that lost its lease stops within one renewal period).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardyard.checkpoint.lease import LeaseLost
from shardyard.checkpoint.store import RunStorage

log = logging.getLogger("shardyard")

PREEMPT_FILE = "PREEMPT"


class Diverged(RuntimeError):
    """The loss (or gradient norm) is not finite: nothing from this state is committed."""


@dataclass
class Verdict:
    preempt: bool = False
    lease_lost: str | None = None
    nonfinite: bool = False


class StepGuard:
    def __init__(self, run_uri: str, rank: int, device: torch.device, fence: Callable[[], None] | None,
                 lease_every_s: float, notice_every_s: float = 1.0) -> None:
        self.storage = RunStorage(run_uri)
        self.rank, self.device, self.fence = rank, device, fence
        self.lease_every_s, self.notice_every_s = lease_every_s, notice_every_s
        self._next_lease = self._next_notice = time.monotonic()
        self._lost: str | None = None

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
        flags = torch.tensor([float(preempt), float(lost), 0.0], device=self.device)
        finite = torch.isfinite(loss.detach().float())
        if grad_norm is not None:
            finite &= torch.isfinite(grad_norm.detach().float().to(self.device))
        flags[2] = (~finite).float()
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        preempt_all, lost_all, nonfinite = (bool(v) for v in flags.tolist())
        reason = (self._lost or "this launch's lease was taken over by another launch") if lost_all else None
        return Verdict(preempt=preempt_all, lease_lost=reason, nonfinite=nonfinite)
