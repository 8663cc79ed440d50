"""Each worker of an in-place group: a Ray actor that waits until a generation of the group names
it, forms that generation's process group, trains (taking the group's state from a live peer when
it joins a running group), and ends when it leaves the group or the run ends."""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from shardyard.checkpoint.lease import LeaseFence, LeaseLost
from shardyard.runtime import select_device
from shardyard.spec import JobSpec
from shardyard.storage.events import Event, log_event
from shardyard.train.callbacks import HoldAtSteps, LedgerCallback, RunEvents
from shardyard.train.elastic_group import Roster
from shardyard.train.startup import StartupPhases
from shardyard.train.step_guard import Diverged
from shardyard.train.trainer import Callback, Trainer


@ray.remote
class GroupWorker:
    """One worker for the life of its membership. Created with the run's per-worker resources;
    `threads`: its share of the CPU cores it reserves, for torch's intra-op threads."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        os.environ["OMP_NUM_THREADS"] = str(max(1, threads))

    def ready(self) -> bool:
        """Answers once the actor's process has started (its imports done)."""
        return True

    def train(self, name: str, address: str, spec: JobSpec, config: dict[str, Any]) -> dict[str, Any]:
        """Join the group as `name` and train. `config`: the launch's id, lease and start-up marks,
        whether workers use GPUs, and its hold points. Returns how this worker's part ended: whether
        it left the group, and the last generation it was in."""
        entered_at = time.time()
        roster = Roster(address, name)
        generation = roster.wait_for_membership()
        device = select_device(0, config["use_gpu"])
        roster.form(generation, "nccl" if device.type == "cuda" else "gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        fence = LeaseFence(spec.run_uri, config["lease_generation"], config["lease_id"], config["lease_base_step"])
        callbacks: list[Callback] = [RunEvents(), StartupPhases(config["launch_id"], config["startup"], entered_at)]
        if spec.run.sample_ledger:
            callbacks.append(LedgerCallback(spec.run_uri, name, roster.attempt))
        if config["hold_at"]:
            callbacks.append(HoldAtSteps(config["hold_at"]))
        if spec.checkpoint.publish_to is not None:
            from shardyard.train.publish import WeightsPublisher  # Serve, for runs that publish only

            callbacks.append(WeightsPublisher(spec.checkpoint.publish_to,
                                              spec.checkpoint.publish_every_n_steps or spec.checkpoint.every_n_steps))
        trainer = Trainer.build(spec, rank, world_size, device, callbacks=callbacks, fence=fence, roster=roster,
                                progress_bar=config["progress_bar"])
        try:
            trainer.train(join=generation.number > 0)
        except (LeaseLost, Diverged) as err:  # every rank raised it at the same step: the group ends here
            if trainer.rank == 0:
                kind = Event.LEASE_LOST if isinstance(err, LeaseLost) else Event.DIVERGED
                log_event(spec.run_uri, kind, launch=config["launch_id"], reason=str(err), step=trainer.state.step)
            return {"left": False, "generation": roster.current.number}
        if trainer.preempted and trainer.rank == 0:
            log_event(spec.run_uri, Event.PREEMPTED, launch=config["launch_id"], step=trainer.state.step)
        if dist.is_initialized():
            dist.destroy_process_group()
        return {"left": trainer.left, "generation": roster.current.number}
