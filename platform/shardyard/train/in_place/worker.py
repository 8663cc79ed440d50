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

from shardyard.checkpoint.lease import LeaseFence
from shardyard.runtime import select_device
from shardyard.spec import JobSpec
from shardyard.train.elastic_group import Roster
from shardyard.train.trainer import Trainer
from shardyard.train.worker_run import launch_callbacks, train_to_end


@ray.remote
class GroupWorker:
    """One worker for the life of its membership. Created with the run's per-worker resources;
    `threads`: its share of the CPU cores it reserves, for torch's intra-op threads."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        os.environ["OMP_NUM_THREADS"] = str(max(1, threads))

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
        callbacks = launch_callbacks(spec, config, entered_at, (name, roster.attempt))
        trainer = Trainer.build(spec, rank, world_size, device, callbacks=callbacks, fence=fence, roster=roster,
                                progress_bar=config["progress_bar"])
        if train_to_end(trainer, config["launch_id"], join=generation.number > 0) and dist.is_initialized():
            dist.destroy_process_group()
        return {"left": trainer.left, "generation": roster.current.number}
