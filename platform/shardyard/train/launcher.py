"""Driver side: turn a validated JobSpec into a run and report on it.

The launch holds the run's lease for its whole length, checks what needs this machine, the
cluster or the run's storage (train/preflight.py), connects to Ray, then runs the job as a Ray
Train worker group (train/ray_train/, the one Ray Train adapter), as a group that changes size in
place (train/in_place/, `scaling.resize: in_place`) or as parameter-server actors.

Ray Train is told nothing about checkpoints: shardyard's commit records alone say which a run has
(checkpoint/record.py), and Ray Train's own files live apart, under `<run>/ray_train/`, holding
no reference that pruning could break. The workers check the lease (`LeaseFence`) before each
commit and at step boundaries. SIGTERM to the driver (a spot instance's notice, a Kubernetes
eviction, `ray job stop`) asks the workers to checkpoint at the next step boundary and stop
(train/preemption.py); the driver then exits 143.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shardyard.checkpoint.lease import LeaseLost, RunLease
from shardyard.cluster import connect_ray
from shardyard.spec import JobSpec
from shardyard.storage.events import Event, log_event
from shardyard.train.callbacks import hold_steps, injected_crash_step
from shardyard.train.early_sigterm import sigterm_handler_kept, stop_if_terminated
from shardyard.train.metrics import RunResult
from shardyard.train.outcomes import Preempted, RunGaveUp
from shardyard.train.preemption import StoppedAtOnce, preemption_notice, stopped_at_once
from shardyard.train.preflight import preflight
from shardyard.train.ray_train.run import fit
from shardyard.train.startup import driver_marks
from shardyard.train.step_guard import Diverged


def launch(spec: JobSpec, attach_to_running: bool = False, take_over: bool = False,
           began_at: float | None = None, allotment: Callable[[], int] | None = None) -> RunResult:
    """Train `spec` to its end (resuming its newest good checkpoint), holding the run's lease
    throughout: a second launch of the same run is refused (`take_over`: see checkpoint/lease.py).
    `allotment`: the size an in-place group trains at, asked again and again (the pool's)."""
    with RunLease(spec.run_uri, spec.run.name, ttl_s=spec.checkpoint.lease_ttl_s).held(take_over) as lease:
        return _launch(spec, attach_to_running, lease, began_at, allotment)


def _launch_parameter_servers(spec: JobSpec, lease: RunLease) -> RunResult:
    """The parameter-server run in this driver, with the guarantees of the others: SIGTERM
    checkpoints the step being computed and stops; a non-finite loss or weights stop the run
    before anything from them is committed; a lost lease stops it."""
    from shardyard.train.parameter_server.run import ParameterServerRun

    ps = ParameterServerRun(spec, fence=lease.fence())
    stop_if_terminated()
    with preemption_notice(spec) as notice:
        try:
            result = ps.run()
        except StoppedAtOnce:
            raise StoppedAtOnce(stopped_at_once(spec)) from None
        except (Diverged, LeaseLost) as err:
            log_event(spec.run_uri, Event.DIVERGED if isinstance(err, Diverged) else Event.LEASE_LOST, reason=str(err),
                      step=ps.state.step)
            raise RunGaveUp(f"run '{spec.run.name}' stopped: {err}") from None
    if ps.preempted:
        raise Preempted(f"run '{spec.run.name}' stopped on {notice.by or 'a preemption notice'} after committing "
                        f"step {ps.state.step}; launch it again to continue from there", notice.by)
    return result


def _launch(spec: JobSpec, attach_to_running: bool, lease: RunLease, began_at: float | None,
            allotment: Callable[[], int] | None) -> RunResult:
    stop_if_terminated()
    preflight(spec)
    stop_if_terminated()
    fault_injection = {"crash_at_checkpoint": injected_crash_step(), "hold_at": hold_steps()}
    largest = spec.scaling.world_sizes[-1] * spec.scaling.resources_per_worker.get("CPU", 1.0)
    ray_started_at = time.time()
    with sigterm_handler_kept():
        can_grow = connect_ray(largest, attach_to_running)
    ray_start_s = time.time() - ray_started_at
    if spec.parallelism.strategy == "parameter_server":  # its own actors, not a Ray Train group
        return _launch_parameter_servers(spec, lease)
    marks = driver_marks(ray_started_at, ray_start_s, began_at)
    if spec.scaling.resize == "in_place":  # its own actors: Ray Train restarts its group on every change
        from shardyard.train.in_place.run import fit_in_place

        return fit_in_place(spec, lease, can_grow, marks, fault_injection, allotment)
    return fit(spec, lease, can_grow, marks, fault_injection)
