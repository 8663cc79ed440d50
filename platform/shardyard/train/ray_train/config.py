"""What Ray Train is told about a run: its worker group, failure detection and restart timing,
torch's process groups (torchft's under hot recovery), and the controller's callback that logs
each failure."""

from __future__ import annotations

import os
import sys
from typing import Any

from ray.train import ScalingConfig, UserCallback
from ray.train.torch import TorchConfig

from shardyard.spec import JobSpec
from shardyard.storage.events import Event, log_event
from shardyard.train.ray_train.worker_resources import place_workers


def scaling_config(spec: JobSpec, cluster: dict[str, float], can_grow: bool) -> ScalingConfig:
    """Ray Train's worker group for `spec` on a cluster with `cluster` resources (see
    train/worker_resources.py for where the workers go and why)."""
    placement = place_workers(spec, cluster, can_grow)
    if placement.reason:  # the user reads it before Ray's output, not in a log file
        print(f"shardyard: {placement.reason}", file=sys.stderr, flush=True)
    s = spec.scaling
    num_workers = s.num_workers if s.num_workers is not None else (s.min_workers, s.max_workers)
    return ScalingConfig(num_workers=num_workers, use_gpu=placement.use_gpu, resources_per_worker=placement.resources,
                         elastic_resize_monitor_interval_s=s.resize_check_interval_s)


def tune_ray_train(spec: JobSpec) -> None:
    """Failure detection and restart timing that Ray Train reads from the driver's environment
    (and passes on to its controller). After a node is lost, a restart may first be tried at the
    old size on stale resource data; the start timeout bounds how long that doomed try waits."""
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(spec.scaling.health_check_interval_s)
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(spec.scaling.worker_start_timeout_s)
    # Ray Train sends each worker's print() to its logger, which writes it to stderr, and prints it
    # too where Ray has wrapped the worker's stdout, as it has: every progress line came out twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")


# How long the Lighthouse waits for a replica that is alive (heartbeating) but has not asked to
# join a quorum yet. torchft's Python default is short: replicas behind a live one (a rank that
# failed to heal from a peer killed mid-copy, and a replacement) then formed a quorum without it,
# ran again a step it had already applied, and went on with it on two different states (a CI
# run's ledger: step 26 committed by two quorums). A live replica asks at the latest once a
# collective on a dead peer fails (the process group's timeout, fault_tolerant_ddp.TIMEOUT, 30 s);
# the others' quorum requests time out after torchft's 60 s.
STRAGGLER_JOIN_TIMEOUT_MS = 45_000


def torch_config(spec: JobSpec) -> TorchConfig | None:
    """Ray Train's default (nccl on GPUs, gloo otherwise), except under hot recovery: there every
    worker is a replica in a process group of its own, coordinated by torchft's Lighthouse, which
    Ray Train runs (one quorum member is enough to go on once the others are dead: a replica that
    stops heartbeating is left out at once, a live one is waited for)."""
    if spec.scaling.recovery != "hot":
        return None
    from ray.train.v2.torch.torchft_config import TorchftConfig

    return TorchftConfig(lighthouse_kwargs={"min_replicas": 1, "join_timeout_ms": STRAGGLER_JOIN_TIMEOUT_MS})


class FailureLog(UserCallback):
    """Runs on the Ray Train controller: records each worker failure before the group restarts."""

    def __init__(self, run_uri: str) -> None:
        self.run_uri = run_uri

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {r: f"{type(e).__name__}: {e}"[:300] for r, e in sorted(worker_exceptions.items())}
        # Raised by the training code (a bug, bad data, a model that cannot fit), not Ray's own
        # report of a process or node lost: only such errors can repeat deterministically.
        lost = [r for r, e in sorted(worker_exceptions.items()) if type(e).__module__.startswith("ray.")]
        log_event(self.run_uri, Event.FAILURE, ranks=sorted(errors), errors=errors, from_code=not lost, lost=lost)
