"""One launch of a validated job, as `shardyard train`, jobs/train.py (`ray job submit`) and the
Python API's `fit` run it: what needs no Ray is said first, then the run trains on Ray Train
(a local Ray unless one is running or named), its console lines filtered, to its end."""

from __future__ import annotations

import os

from shardyard.spec import JobSpec, SpecError
from shardyard.train.metrics import RunResult


class NothingToTrain(Exception):
    """The run is already at run.steps: nothing was launched (the message says how to go on)."""


def train_job(spec: JobSpec, attach_to_running: bool, take_over: bool = False) -> RunResult:
    """Train `spec` to run.steps, resuming its newest good checkpoint. Raises SpecError for a data
    path that is not there, NothingToTrain, and the launch's own outcomes (train/outcomes.py).
    `attach_to_running`: join the cluster running on this machine, if there is one."""
    from shardyard.checkpoint.record import newest_step
    from shardyard.storage.store import RunStorage

    for key in ("path", "validation_path"):  # said before Ray and torch load; the preflight checks the rest
        path = getattr(spec.data, key)
        if path is not None and "://" not in path and not os.path.exists(path):
            raise SpecError(f"data.{key} {path!r} does not exist")
    done = newest_step(RunStorage(spec.run_uri))
    if done >= spec.run.steps:  # nothing to train: no Ray, no summary of 0 steps
        raise NothingToTrain(f"run '{spec.run.name}' is already at step {done} (run.steps={spec.run.steps}): "
                             f"nothing to train. Train it longer with --set run.steps={done + spec.run.steps}, or "
                             f"start a new run with --set run.name=NAME")
    import ray

    from shardyard.train.console import ray_console
    from shardyard.train.launcher import launch  # imports Ray: only once the spec is valid

    # Ray forwards lines until this driver leaves it (a controller's traceback as it ends): the
    # console filter stays in front of them until then. A caller already connected (a script, a
    # notebook) stays connected.
    connected_before = ray.is_initialized()
    with ray_console(spec.run_uri, spec.run.name):
        try:
            return launch(spec, attach_to_running=attach_to_running, take_over=take_over)
        finally:
            if not connected_before:
                ray.shutdown()
