"""The per-worker training loop that Ray Train runs on every worker."""

from __future__ import annotations

import time
from typing import Any

import ray.train
import torch
import torch.distributed as dist

from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.data.ledger import SampleLedger
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.runtime import select_device
from shardyard.spec import GPTSpec, JobSpec, parse_spec
from shardyard.train import checkpoint
from shardyard.train.checkpoint import TrainState
from shardyard.train.metrics import MetricsFile, MetricsLog, Progress, Throughput, log_event, read_events


def train_worker(config: dict[str, Any]) -> None:
    """Entry point of each Ray Train worker.

    `config["spec"]` is the validated job spec as a dict; `config["progress_bar"]` says whether the
    driver has a terminal to draw a bar on; `config["crash_at_checkpoint"]` is an injected fault
    (see launcher.injected_crash_step).
    """
    written = parse_spec(config["spec"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = select_device(context.get_local_rank())
    # The spec as it runs at this world size (validated for every size before the run started):
    # the pipeline mesh may be re-planned and, if the spec allows it, the global batch changed.
    spec = written.at_world_size(world_size)

    # Same seed on every rank: identical initial weights, as a single process would build them.
    torch.manual_seed(spec.run.seed)
    engine = build_engine(spec, build_model(spec.model), device, replica_id=f"{spec.run.name}_{rank}")
    dataset = build_dataset(spec)
    order = GlobalSampleOrder(len(dataset), spec.run.seed)
    tokens_per_sample = spec.model.block_size if isinstance(spec.model, GPTSpec) else 1
    global_batch = spec.batch.global_batch_size

    restore_start = time.perf_counter()
    restored = checkpoint.restore_latest(engine, spec.run_dir)
    state = restored or TrainState()
    if rank == 0:  # every worker group start: fresh, resumed, or restarted after a failure
        par = spec.parallelism
        log_event(spec.checkpoint.storage_path, spec.run.name, "start", restored_step=state.step,
                  old_world_size=restored.world_size if restored else None, world_size=world_size,
                  restore_s=time.perf_counter() - restore_start, global_batch=global_batch,
                  mesh={"pp": par.pp, "dp": par.dp_size(world_size), "tp": par.tp},
                  downtime_s=_since_failure(spec))
        if global_batch != written.batch.global_batch_size:
            print(f"shardyard: world size {world_size} cannot keep batch.global_batch_size "
                  f"{written.batch.global_batch_size}; training with {global_batch} "
                  f"(batch.allow_global_batch_change)", flush=True)
    state.world_size = world_size
    ledger = None
    if spec.run.sample_ledger:
        attempt = [time.time()]  # one id for this worker group (collective): rank 0's start time
        dist.broadcast_object_list(attempt, src=0)
        if engine.replicated_state:
            # Replicas are not one group and replacements join a running step sequence: one id.
            attempt = [0.0]
        if engine.data_owner:
            ledger = SampleLedger(spec.run_dir, rank, attempt[0])
    progress = Progress(spec.run.steps, state.step, config["progress_bar"]) if rank == 0 else None
    log = MetricsLog(MetricsFile(spec.checkpoint.storage_path, spec.run.name), state.step) if rank == 0 else None
    throughput = Throughput()
    writer = checkpoint.CheckpointWriter(spec.checkpoint.async_write)
    loss_sum, steps_since_report = torch.zeros((), device=device), 0

    while state.step < spec.run.steps:
        engine.begin_step(state)
        if engine.healed_from is not None:
            log_event(spec.checkpoint.storage_path, spec.run.name, "healed", rank=rank,
                      from_step=engine.healed_from, to_step=state.step)
        # The data-parallel size may change from step to step (hot recovery): the global batch not.
        accum_steps = global_batch // (spec.batch.micro_batch_size * engine.dp_size)
        ids = micro_batch_ids(order, state.samples_seen, engine.dp_rank, engine.dp_size,
                              spec.batch.micro_batch_size, accum_steps)
        if ledger:
            # Ranks that train this step: the quorum's replicas under hot recovery.
            ledger.training(state.step + 1, engine.dp_size if engine.replicated_state else world_size, ids,
                            engine.quorum_id)
        loss = engine.train_step([dataset.batch(i) for i in ids])
        if loss is None:  # a replica was lost mid-step and this one cannot apply it: run it again
            continue
        loss_sum += loss
        state.step += 1
        if ledger:
            ledger.committed(state.step, engine.quorum_id)
        state.samples_seen += global_batch
        steps_since_report += 1
        throughput.add(global_batch, global_batch * tokens_per_sample)

        last = state.step == spec.run.steps
        save_now = last or state.step % spec.checkpoint.every_n_steps == 0
        if not (save_now or state.step % spec.run.log_every == 0):
            continue
        # One small all-reduce per report, not per step: the logged loss is the global mean.
        dist.all_reduce(loss_sum)
        metrics = {
            "step": state.step,
            "loss": loss_sum.item() / (steps_since_report * engine.loss_ranks),
            "lr": engine.lr,
            "world_size": world_size,
            "global_batch": global_batch,
            "samples_seen": state.samples_seen,
            "epoch": state.samples_seen / len(dataset),
            **throughput.read(),
        }
        if rank == 0:  # before the checkpoint completes: a run resumed from it has this row
            log.append(metrics)
            progress.update(steps_since_report, metrics)
        if save_now:
            crash = (state.step == config.get("crash_at_checkpoint") and rank == world_size - 1
                     and not _crash_injected(spec, state.step))
            if crash:
                latest = checkpoint.find_latest(spec.run_dir)  # what a restart may use (local storage)
                log_event(spec.checkpoint.storage_path, spec.run.name, "injected_crash", step=state.step,
                          rank=rank, latest_complete=latest.name if latest else None)
            writer.report(metrics, engine, state, written, rank, crash_before_upload=crash)
        loss_sum.zero_()
        steps_since_report = 0
    engine.close()
    if rank == 0:
        progress.close()


def _crash_injected(spec: JobSpec, step: int) -> bool:
    """An injected crash happens once: the restarted run must get past that step."""
    events = read_events(spec.checkpoint.storage_path, spec.run.name)
    return any(e["event"] == "injected_crash" and e["step"] == step for e in events)


def _since_failure(spec: JobSpec) -> float | None:
    """Seconds from the failure that caused this worker-group start to now (None if none did)."""
    events = read_events(spec.checkpoint.storage_path, spec.run.name)
    last_start = max((i for i, e in enumerate(events) if e["event"] == "start"), default=-1)
    failures = [e for e in events[last_start + 1:] if e["event"] == "failure"]
    return time.time() - failures[0]["time"] if failures else None
