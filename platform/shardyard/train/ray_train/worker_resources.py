"""What each Ray Train worker reserves, and whether the cluster can ever hold the group.

`scaling.use_gpu: auto` trains on GPUs when the cluster has them. A cluster that can grow (an
autoscaler, more machines joining) may be waited for; a local Ray instance started for one
command cannot grow, so a group it can never hold would wait forever (README's default job, two
workers, on a machine with one GPU did). There the choice is made at once: the GPUs train when
they hold the group, else the CPUs do, saying why and which setting puts the GPUs to work; an
explicit `use_gpu: true` or a resource the machine lacks stops the launch, naming the setting.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from shardyard.spec import JobSpec, SpecError

log = logging.getLogger("shardyard")


@dataclass(frozen=True)
class WorkerPlacement:
    use_gpu: bool
    resources: dict[str, float]
    reason: str = ""  # why GPUs the cluster has are left idle, when they are


def _plural(n: float, noun: str) -> str:
    return f"{n:g} {noun}{'' if n == 1 else 's'}"


def _shortfall(per_worker: dict[str, float], workers: int, cluster: dict[str, float]) -> dict[str, tuple[float, float]]:
    return {k: (v * workers, cluster.get(k, 0.0)) for k, v in per_worker.items() if v * workers > cluster.get(k, 0.0)}


def _described(short: dict[str, tuple[float, float]]) -> str:
    return ", ".join(f"{k}: need {need:g}, cluster has {have:g}" for k, (need, have) in short.items())


def place_workers(spec: JobSpec, cluster: dict[str, float], can_grow: bool) -> WorkerPlacement:
    """Each worker's resources and whether they include a GPU, for a cluster with `cluster`
    resources in all; SpecError where a cluster that cannot grow can never hold the group."""
    s = spec.scaling
    fewest = s.world_sizes.start
    resources = dict(s.resources_per_worker)
    gpus = cluster.get("GPU", 0.0)
    use_gpu = gpus > 0 if s.use_gpu == "auto" else s.use_gpu
    reason = ""
    if use_gpu:
        resources.setdefault("GPU", 1.0)
        gpu_short = _shortfall({"GPU": resources["GPU"]}, fewest, cluster)
        if gpu_short and not can_grow:
            fit = math.floor(gpus / resources["GPU"])
            setting = (f"--set scaling.num_workers={fit}" if s.num_workers is not None
                       else f"--set scaling.min_workers={fit}")
            if s.use_gpu is True or "GPU" in s.resources_per_worker:
                if fit == 0:
                    raise SpecError("scaling asks for GPUs and this machine's Ray instance has none; "
                                    "set scaling.use_gpu=auto to train on CPU")
                raise SpecError(f"{_plural(gpus, 'GPU')} cannot hold {fewest} workers of "
                                f"{_plural(resources['GPU'], 'GPU')} each and this machine's Ray instance "
                                f"cannot grow: {setting} to train on {fit}, or scaling.use_gpu=auto "
                                f"to train on CPU")
            use_gpu = False
            del resources["GPU"]
            reason = (f"{_plural(gpus, 'GPU')} cannot hold {fewest} workers and this machine's Ray "
                      f"instance cannot grow, so training runs on CPU"
                      + (f"; {setting} trains on the GPU{'s' if fit > 1 else ''}" if fit else ""))
    if spec.run.precision == "float8" and not use_gpu:
        raise SpecError("run.precision float8 trains on GPUs of compute capability 8.9 or later and this launch's "
                        "workers run on CPU" + (f" ({reason})" if reason else "") + ": use run.precision auto")
    short = _shortfall(resources, fewest, cluster)
    if short and not can_grow:
        raise SpecError(f"this machine's Ray instance cannot hold {fewest} workers ({_described(short)}) "
                        f"and cannot grow: lower scaling.resources_per_worker or the number of workers")
    if short:
        log.warning("the cluster cannot yet hold %d workers (%s); waiting for it to scale up",
                    fewest, _described(short))
    return WorkerPlacement(use_gpu, resources, reason)
