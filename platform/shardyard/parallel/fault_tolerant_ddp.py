"""DDP whose replicas outlive each other's failures (TorchFT), for `scaling.recovery: hot`.

Each Ray Train worker is one replica (Ray Train's TorchftConfig gives every worker a process
group of its own and runs torchft's Lighthouse). Every step begins with a quorum: the replicas
alive now agree on who takes part, and one that is behind (a replacement Ray Train has just
started) heals by copying model, optimizer, schedule and trainer state from a live peer instead
of reading storage. Gradients are averaged over the quorum through torchft's fault-tolerant
all-reduce. A step during which a replica dies is applied by the replicas whose all-reduce
completed (it then summed every replica's gradients) and run again by the others only if no
replica applied it: those that fell behind heal from one that did at the next quorum. The
survivors split the same global batch among themselves: the global batch and the sample order
stay exact, only the accumulation per replica changes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing.pg_transport import PGTransport

from shardyard.models import LossFn
from shardyard.parallel.engine import Engine, MicroBatch

# Long enough to re-form the replicas' process group on a loaded machine after a failure.
TIMEOUT = timedelta(seconds=30)
# torchft logs every quorum and commit at INFO: thousands of lines a minute.
for _name in ("torchft", "torchft_quorums", "torchft_commits"):
    logging.getLogger(_name).setLevel(logging.WARNING)


class FaultTolerantDDPEngine(Engine):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loss_fn: LossFn, grad_clip: float,
                 device: torch.device, amp_dtype: torch.dtype | None, replica_id: str) -> None:
        super().__init__([model], [optimizer], [scheduler], loss_fn, grad_clip, device, amp_dtype)
        self.train_state: Any = None  # the loop's TrainState, shared with healing peers
        pg = (ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=TIMEOUT)
        self.manager = Manager(
            pg=pg, load_state_dict=self._load_state_dict, state_dict=self._state_dict,
            min_replica_size=1, use_async_quorum=False,  # quorum (and healing) before choosing data
            timeout=TIMEOUT * 2, rank=0, world_size=1, replica_id=replica_id,
            checkpoint_transport=PGTransport(pg, timeout=TIMEOUT, device=device),
        )

    def _state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizers[0].state_dict(),
                "scheduler": self.schedulers[0].state_dict(), "trainer": asdict(self.train_state)}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizers[0].load_state_dict(state["optim"])
        self.schedulers[0].load_state_dict(state["scheduler"])
        for key, value in state["trainer"].items():
            setattr(self.train_state, key, value)

    def begin_step(self, state: Any) -> None:
        """Join this step's quorum (healing first if behind); then dp_rank and dp_size say which
        share of the global batch this replica trains on."""
        self.train_state = state
        if self.manager.current_step() != state.step:  # restored from storage, not yet told
            self.manager.load_state_dict({"step": state.step, "batches_committed": 0})
        self.manager.start_quorum()
        self.dp_rank = self.manager.participating_rank()
        self.dp_size = self.manager.num_participants()
        # torchft 0.2 has no public accessor; the sample ledger needs it to tell a step committed
        # by this quorum from the same step run again by a later one.
        self.step_round = self.manager._quorum_id

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor | None:
        """One step over this replica's share; None if this replica cannot apply it (a quorum
        member was lost): the loop then runs the step again, or heals from a replica that did."""
        loss = self.forward_backward(micro_batches)
        grads = [p.grad for p in self.model.parameters()]
        # One all-reduce for every gradient and the loss, averaged over the quorum.
        flat = torch.cat([*(g.reshape(-1) for g in grads), loss.reshape(1)])
        self.manager.allreduce(flat).wait()
        if not self.manager.should_commit():
            self.optimizers[0].zero_grad(set_to_none=True)
            return None
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        if self.grad_clip > 0:
            self.clip_grad_norm(self.grad_clip)
        self.optimizers[0].step()
        self.schedulers[0].step()
        self.optimizers[0].zero_grad(set_to_none=True)
        return flat[-1]

    def close(self) -> None:
        self.manager.shutdown()
