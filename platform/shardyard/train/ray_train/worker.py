"""Each Ray Train worker: builds a `Trainer` from the spec and its place in the worker group, with
the launch's lease fence and callbacks, and trains."""

from __future__ import annotations

import time
from typing import Any

import ray
import torch.distributed as dist

from shardyard.checkpoint.lease import LeaseFence, LeaseLost
from shardyard.runtime import select_device
from shardyard.spec import JobSpec
from shardyard.storage.events import Event, log_event, read_events
from shardyard.train.callbacks import group_attempt
from shardyard.train.outcomes import repeated_failure
from shardyard.train.trainer import Trainer
from shardyard.train.worker_run import launch_callbacks, train_to_end


def node_drained() -> bool:
    """Collective over the worker group: whether Ray is draining a worker's node (a spot instance's
    reclaim notice, `ray drain-node`); the run then checkpoints at once (Ray Train restarts the
    group from it when the node goes). Not under hot recovery: replicas are no one group."""
    return ray.train.get_preemption_info() is not None


def train_worker(config: dict[str, Any]) -> None:
    """Entry point of each Ray Train worker. `config["spec"]` is the job spec as the driver
    validated it (not validated again here: that would import a custom model's factory and read a
    Hugging Face config in every worker); `progress_bar` says whether the driver has a terminal to draw a bar on;
    `crash_at_checkpoint` and `hold_at` are fault-injection settings read on the driver."""
    entered_at = time.time()
    spec: JobSpec = config["spec"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    launch_id = config["launch_id"]
    fence = LeaseFence(spec.run_uri, config["lease_generation"], config["lease_id"], config["lease_base_step"])
    try:
        fence()
    except LeaseLost as err:  # a group restarted after its launch lost the run: it starts nothing
        if rank == 0:
            log_event(spec.run_uri, Event.LEASE_LOST, launch=launch_id, reason=str(err))
        return
    reason = repeated_failure(read_events(spec.run_uri), launch_id)
    if reason is not None:  # every rank reads the same events: all of them end here
        if rank == 0:
            log_event(spec.run_uri, Event.GAVE_UP, launch=config["launch_id"], reason=reason)
        return
    hot = spec.scaling.recovery == "hot"
    if not hot:  # hot-recovery replicas are no one group: they keep the launch's fence
        # This worker group's own attempt: a group Ray Train gave up on that still runs (a node cut
        # off from Ray but not from storage) is fenced off, and its late commits are stale.
        group_fence: list[LeaseFence] = [fence.for_new_group() if rank == 0 else fence]
        if dist.is_initialized():
            dist.broadcast_object_list(group_fence, src=0)
        fence = group_fence[0]
    # Hot-recovery replicas are not one group, and replacements join a running step sequence: one
    # ledger attempt id for all of them.
    ledger = (f"rank{rank}", 0.0 if hot else group_attempt()) if spec.run.sample_ledger else None
    callbacks = launch_callbacks(spec, config, entered_at, ledger)
    device = select_device(context.get_local_rank(), config["use_gpu"])
    trainer = Trainer.build(spec, rank, world_size, device, callbacks=callbacks,
                            checkpoint_writer=not hot or rank == 0, fence=fence,
                            node_drained=None if hot else node_drained,
                            replica_id=f"{spec.run.name}_{rank}", progress_bar=config["progress_bar"])
    train_to_end(trainer, launch_id)
