"""Driver side: turn a validated JobSpec into a Ray Train V2 TorchTrainer run and report on it."""

from __future__ import annotations

import logging
import math
import os
import posixpath
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from shardyard.data.corpus import corpus_files
from shardyard.spec import JobSpec, SpecError
from shardyard.train.checkpoint import find_latest, prune_unregistered
from shardyard.train.loop import train_worker
from shardyard.train.metrics import FailureLog, MetricsFile, format_table, summarize

log = logging.getLogger("shardyard")


@dataclass
class RunResult:
    run_dir: Path
    checkpoint: str | None
    summary: dict[str, Any]


# torchft's Lighthouse (hot recovery) logs every quorum at INFO, several lines per step.
QUIET = {"env_vars": {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}}


def connect_ray(spec: JobSpec, attach_to_running: bool = False) -> None:
    """Attach to the cluster in RAY_ADDRESS (set inside `ray job submit` jobs), optionally to one
    already running on this machine, or else start a local Ray instance for this run."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=QUIET)
        return
    if attach_to_running:
        try:
            ray.init(address="auto", runtime_env=QUIET)
            return
        except ConnectionError:
            pass
    # address="local": a new instance even if an earlier cluster left its address behind.
    # It gets at least enough logical CPUs for the largest worker group, so a 4-worker job still
    # runs (oversubscribed, slower) on a 2-core laptop. No dashboard: on a small machine its
    # processes cost ~10% of training throughput (benchmarks/ddp_overhead.py); for the dashboard,
    # `ray start --head` and point RAY_ADDRESS at it.
    largest = spec.scaling.world_sizes[-1] * spec.scaling.resources_per_worker.get("CPU", 1.0)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(largest)), include_dashboard=False,
             runtime_env=QUIET)


def preflight(spec: JobSpec) -> None:
    """Checks that need this machine or the cluster, done before any worker starts."""
    if spec.data.name == "corpus":
        try:
            corpus_files(spec.data.path)
        except FileNotFoundError as err:
            raise SpecError(str(err)) from None
    if spec.data.name == "corpus" and getattr(spec.model, "vocab_size", 256) < 256:
        raise SpecError("data.name 'corpus' is byte-level: model.vocab_size must be at least 256")


def scaling_config(spec: JobSpec) -> ScalingConfig:
    s = spec.scaling
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0 if s.use_gpu == "auto" else s.use_gpu
    resources = dict(s.resources_per_worker)
    if use_gpu:
        resources.setdefault("GPU", 1.0)
    num_workers = s.num_workers if s.num_workers is not None else (s.min_workers, s.max_workers)
    _check_capacity(spec, resources)
    return ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources,
                         elastic_resize_monitor_interval_s=s.resize_check_interval_s)


def _check_capacity(spec: JobSpec, per_worker: dict[str, float]) -> None:
    """A fixed-size group that the cluster can never hold would wait forever: say so now.
    (An autoscaling cluster may still grow, so this only warns.)"""
    minimum = spec.scaling.world_sizes.start
    total = ray.cluster_resources()
    short = {k: (v * minimum, total.get(k, 0.0)) for k, v in per_worker.items()
             if v * minimum > total.get(k, 0.0)}
    if short:
        detail = ", ".join(f"{k}: need {need:g}, cluster has {have:g}" for k, (need, have) in short.items())
        log.warning("the cluster cannot yet hold %d workers (%s); waiting for it to scale up",
                    minimum, detail)


def tune_ray_train(spec: JobSpec) -> None:
    """Failure detection and restart timing that Ray Train reads from the driver's environment
    (and passes on to its controller). After a node is lost, a restart may first be tried at the
    old size on stale resource data; the start timeout bounds how long that doomed try waits."""
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(spec.scaling.health_check_interval_s)
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(spec.scaling.worker_start_timeout_s)


def torch_config(spec: JobSpec) -> TorchConfig | None:
    """Ray Train's default (nccl on GPUs, gloo otherwise), except under hot recovery: there every
    worker is a replica in a process group of its own, coordinated by torchft's Lighthouse, which
    Ray Train runs (one quorum member is enough to go on)."""
    if spec.scaling.recovery != "hot":
        return None
    from ray.train.v2.torch.torchft_config import TorchftConfig

    return TorchftConfig(lighthouse_kwargs={"min_replicas": 1})


CRASH_ENV = "SHARDYARD_INJECT_CRASH"


def injected_crash_step() -> int | None:
    """Fault injection for recovery drills: `SHARDYARD_INJECT_CRASH=checkpoint:STEP` makes the
    last rank die (SIGKILL) once, while the checkpoint of STEP is being written: after its shard
    is saved, before it reaches storage, while the other ranks upload theirs."""
    value = os.environ.get(CRASH_ENV)
    if not value:
        return None
    where, _, step = value.partition(":")
    if where != "checkpoint" or not step.isdigit():
        raise SpecError(f"{CRASH_ENV}={value!r}: expected checkpoint:STEP, e.g. checkpoint:100")
    return int(step)


def launch(spec: JobSpec, attach_to_running: bool = False) -> RunResult:
    preflight(spec)
    crash_step = injected_crash_step()
    connect_ray(spec, attach_to_running)
    if spec.parallelism.strategy == "parameter_server":  # its own actors, not a Ray Train group
        from shardyard.parallel.parameter_server import run

        return run(spec)
    tune_ray_train(spec)
    trainer = TorchTrainer(
        train_worker,
        torch_config=torch_config(spec),
        train_loop_config={"spec": spec.model_dump(mode="json"), "progress_bar": sys.stdout.isatty(),
                           "crash_at_checkpoint": crash_step},
        scaling_config=scaling_config(spec),
        run_config=RunConfig(
            # Same name + storage path as an earlier run: Ray Train restores its checkpoint list
            # and the workers resume from the latest checkpoint.
            name=spec.run.name,
            storage_path=spec.checkpoint.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpoint.keep),
            failure_config=FailureConfig(max_failures=spec.scaling.max_failures),
            callbacks=[FailureLog(spec.checkpoint.storage_path, spec.run.name)],
            # Ray Train's per-report INFO lines would drown shardyard's own progress output.
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )
    start = time.perf_counter()
    result = trainer.fit()
    title = f"shardyard run '{spec.run.name}' ({spec.parallelism.strategy})"
    summary = summarize(MetricsFile(spec.checkpoint.storage_path, spec.run.name), title,
                        time.perf_counter() - start)
    if result.checkpoint is not None:
        prune_unregistered(result.checkpoint.filesystem, posixpath.dirname(result.checkpoint.path),
                           older_than=posixpath.basename(result.checkpoint.path))
    # Hot-recovery runs write checkpoints themselves, outside Ray Train's list.
    latest = find_latest(spec.run_dir) if result.checkpoint is None else None
    checkpoint = result.checkpoint.path if result.checkpoint else (str(latest) if latest else None)
    summary["checkpoint"] = checkpoint
    print(format_table(title, summary), flush=True)
    return RunResult(spec.run_dir, checkpoint, summary)
