"""A launch as a Ray Train run: the TorchTrainer, `fit` on a thread of its own (so that this
launcher's own Ctrl-C handling applies, not Ray Train's), and how it ended, from its events."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.train import FailureConfig, LoggingConfig, RunConfig, TrainingFailedError
from ray.train.torch import TorchTrainer

from shardyard.checkpoint.lease import RunLease
from shardyard.checkpoint.record import newest_step
from shardyard.spec import JobSpec
from shardyard.storage.events import Event, log_event
from shardyard.storage.store import RunStorage
from shardyard.train.early_sigterm import stop_if_terminated
from shardyard.train.metrics import RunResult
from shardyard.train.outcomes import RunGaveUp, failure_summary, launch_result
from shardyard.train.preemption import StoppedAtOnce, preemption_notice, stopped_at_once
from shardyard.train.ray_train.config import FailureLog, scaling_config, torch_config, tune_ray_train
from shardyard.train.ray_train.worker import train_worker
from shardyard.train.restart_lines import restart_lines, restarts_allowed


def fit(spec: JobSpec, lease: RunLease, can_grow: bool, startup: dict[str, float],
        fault_injection: dict[str, Any]) -> RunResult:
    """Train `spec` as a Ray Train worker group, connected to Ray and holding the run's `lease`;
    raise RunGaveUp or Preempted as the launch's events say it ended."""
    tune_ray_train(spec)
    launch_id = uuid.uuid4().hex
    scaling = scaling_config(spec, ray.cluster_resources(), can_grow)
    log_event(spec.run_uri, Event.LAUNCH, id=launch_id, lease_generation=lease.generation)

    def trainer() -> TorchTrainer:
        return TorchTrainer(
            train_worker,
            torch_config=torch_config(spec),
            train_loop_config={"spec": spec, "progress_bar": sys.stdout.isatty(),
                               "launch_id": launch_id, "lease_generation": lease.generation, "lease_id": lease.id,
                               "lease_base_step": lease.base_step,
                               "use_gpu": scaling.use_gpu, "startup": startup,
                               **fault_injection},
            scaling_config=scaling,
            run_config=RunConfig(
                # Ray Train's own files, apart from the checkpoints it is never told of: the workers
                # resume from the newest good checkpoint by shardyard's commit records.
                name=spec.run.name,
                storage_path=RunStorage(spec.run_uri).url("ray_train"),
                failure_config=FailureConfig(max_failures=spec.scaling.max_failures),
                callbacks=[FailureLog(spec.run_uri)],
                # Ray Train's per-report INFO lines would drown shardyard's own progress output.
                logging_config=LoggingConfig(log_level="WARNING"),
            ),
        )

    start = time.perf_counter()
    stop_if_terminated()
    relaunches = 0
    with preemption_notice(spec) as notice, restart_lines(spec.run_uri, launch_id, spec.scaling.max_failures):
        while True:
            try:
                fit_in_background(trainer())
                break
            except StoppedAtOnce:
                raise StoppedAtOnce(stopped_at_once(spec)) from None
            except TrainingFailedError as err:  # Ray Train gave up: its tracebacks are in the run's Ray log
                step = newest_step(RunStorage(spec.run_uri))
                if lost_a_worker_actor(err) and not 0 <= spec.scaling.max_failures <= relaunches:
                    relaunches += 1
                    print(f"shardyard: {failure_summary(err)}; launching the worker group again from step {step} "
                          f"({relaunches} of {restarts_allowed(spec.scaling.max_failures)})", file=sys.stderr,
                          flush=True)
                    continue
                # Its restarts ran out, or its controller failed with an error it does not retry.
                why = ("" if getattr(err, "controller_failure", None) is not None else
                       f"; scaling.max_failures ({restarts_allowed(spec.scaling.max_failures)}) restarts were used")
                raise RunGaveUp(f"run '{spec.run.name}' stopped: {failure_summary(err)}{why}. Launching it again "
                                f"resumes from step {step}") from None
    return launch_result(spec, launch_id, notice.by, f"shardyard run '{spec.run.name}' ({spec.parallelism.strategy})",
                         start)


def lost_a_worker_actor(err: TrainingFailedError) -> bool:
    """Whether Ray Train's controller stopped because a worker's actor died under it (Ray's error,
    not the training code's), which it does not retry itself. Ray Train's placement-group cleaner
    removes a live run's group when Ray's state API misses the run's controller once (a loaded
    machine), and the group's workers die with it while it starts: launching the group again
    goes on from the newest checkpoint."""
    return isinstance(getattr(err, "controller_failure", None), RayActorError)


def fit_in_background(trainer: TorchTrainer) -> None:
    """`trainer.fit()` on a thread of its own, the main thread waiting for it: Ray Train installs
    its Ctrl-C handler (which aborts the workers mid-step, losing what they had not committed) only
    when fit runs on the main thread, and this launcher's own (preemption_notice) checkpoints first.
    The main thread waits in short joins, between which Python runs its signal handlers."""
    raised: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, raised there
            raised.append(err)

    thread = threading.Thread(target=fit, name="shardyard-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if raised:
        raise raised[0]
