"""`shardyard pool POOL.yaml`: one pool of devices shared by a training run and a serving app.

The driver starts (or joins) Ray, starts the arbiter (pool/arbiter.py), trains the run at the
size the arbiter allots, and deploys the app once the run has a checkpoint to serve. When the
allotment changes, a run with `scaling.resize: in_place` changes size at its next step boundary
(a lend is its newest worker leaving, a return a new worker joining and taking its state from a
live peer); any other run is asked to checkpoint at its next step boundary and stop (the
preemption notice's path: `<run>/PREEMPT`), then launched again at the new size from that
checkpoint. Either way the sample order carries across, so no sample is repeated or skipped. Serve places the replicas it is waiting for on the devices the run let go; a replica
Serve stops finishes the requests it holds first. The pool ends with its run (or on SIGTERM,
which checkpoints the run first): the app is deleted and the arbiter's timeline is written to
`<run>/pool/timeline.json`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayError

from shardyard import exit_codes
from shardyard.storage.events import Event, read_events
from shardyard.checkpoint.record import newest_good
from shardyard.storage.store import RunStorage
from shardyard.cluster import QUIET, join, start_local_ray
from shardyard.pool.arbiter import RemoteArbiter, arbiter_name
from shardyard.pool.spec import PoolSpec, check_serving, load_pool, replica_bounds
from shardyard.serve.app.logs import serve_log_levels
from shardyard.serve.engine.builtin import REPLICA_CPUS
from shardyard.serve.engine.metrics import ARBITER_NAMESPACE
from shardyard.spec import JobSpec, SpecError, parse_spec
from shardyard.train.console import ray_console
from shardyard.train.outcomes import Preempted, RunGaveUp
from shardyard.train.launcher import launch
from shardyard.train.step_guard import PREEMPT_FILE

TIMELINE = ("pool", "timeline.json")


def at_size(job: JobSpec, workers: int) -> JobSpec:
    """The elastic job as a fixed-size launch of `workers` (the pool, not Ray Train, picks the size)."""
    raw = job.model_dump(mode="json")
    raw["scaling"].update(num_workers=workers, min_workers=None, max_workers=None)
    return parse_spec(raw)


def connect(pool: PoolSpec, job: JobSpec) -> float:
    """Join RAY_ADDRESS's cluster, or start a local Ray instance holding the pool's devices (a
    custom resource) and CPUs enough for every device's worker or replica (oversubscribed on a
    small machine, as `shardyard train` is). Returns the devices the pool has."""
    devices = pool.pool
    if os.environ.get("RAY_ADDRESS"):
        if devices.units is not None:
            raise SpecError(f"pool.units: on a cluster (RAY_ADDRESS) the pool is every {devices.resource} its nodes "
                            "carry; leave pool.units out")
        join(os.environ["RAY_ADDRESS"], runtime_env=QUIET)
        return ray.cluster_resources().get(devices.resource, 0.0)
    if devices.resource == "GPU":
        raise SpecError("pool.resource GPU: a local Ray instance pools the GPUs of a cluster it joins; set "
                        "RAY_ADDRESS, or pool a custom resource (pool.resource: device, pool.units: N)")
    if devices.units is None:
        raise SpecError("pool.units: a local Ray instance started for the pool needs how many devices to make")
    # The serving config's own reading of its args (nested or dotted, its default where unset).
    replica = REPLICA_CPUS + check_serving(pool.serving.args).engine.cpus_per_shard
    per_device = max(job.scaling.resources_per_worker.get("CPU", 1.0), replica)
    start_local_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(devices.units * per_device)),
                    resources={devices.resource: devices.units})
    return float(devices.units)


class Pool:
    def __init__(self, pool: PoolSpec, job: JobSpec, devices: float) -> None:
        self.pool, self.job = pool, job
        replicas, _ = replica_bounds(pool.serving.args)
        self.size = min(job.scaling.max_workers, int(devices) - replicas)
        if self.size < job.scaling.min_workers:
            raise SpecError(f"the pool's {devices:g} {pool.pool.resource} devices cannot hold training's min_workers "
                            f"({job.scaling.min_workers}) beside serving's autoscaling.min_replicas ({replicas})")
        if replicas == 0 and pool.policy.priority == "training" and self.size >= devices:
            raise SpecError(f"serving.args.autoscaling.min_replicas 0 with policy.priority training: the run holds "
                            f"all {devices:g} devices and never lends one, so a request would wait for a replica "
                            "forever; use policy.priority serving, or a scaling.max_workers that leaves a device free")
        self.storage = RunStorage(job.run_uri)
        self.name = arbiter_name(job.run.name)
        try:
            self.arbiter = RemoteArbiter.options(name=self.name, namespace=ARBITER_NAMESPACE).remote(
                pool.model_dump(mode="json"), job.run_uri, job.scaling.min_workers, job.scaling.max_workers, self.size)
        except ValueError:  # the name is taken: another pool of this run is on the cluster
            raise SpecError(f"a pool for run '{job.run.name}' is already running on this cluster "
                            f"(its arbiter, '{self.name}')") from None
        self.lock = threading.Lock()
        self.resize_asked = False
        self.ended = threading.Event()
        self.serving = False
        self.serving_error: str | None = None
        self.allotted = self.size

    # ------------------------------------------------------------ serving

    def serve_when_ready(self) -> None:
        """Deploy the app once the run has committed a checkpoint; then the arbiter decides."""
        while newest_good(self.storage) is None:
            if self.ended.wait(1.0):
                return
        from shardyard.serve.app.deployment import build_app  # Serve's app imports the engines: only when serving

        s = self.pool.serving
        serve_logging, app_logging = serve_log_levels(own="RAY_ADDRESS" not in os.environ)
        try:
            serve.start(http_options={"host": s.host, "port": s.port}, logging_config=serve_logging)
            serve.run(build_app({**s.args, "report_load_to": self.name}), name=s.app, route_prefix="/",
                      logging_config=app_logging)
        except Exception as err:  # noqa: BLE001 - whatever stops the app from deploying stops the pool, saying why
            self.serving_error = f"{type(err).__name__}: {err}" if not isinstance(err, SpecError) else str(err)
            print(f"shardyard pool: serving did not start: {err}; stopping training", file=sys.stderr, flush=True)
            self.storage.write_bytes(b"serving failed", PREEMPT_FILE)
            return
        print(f"shardyard pool: serving app '{s.app}' on http://{s.host}:{s.port}", flush=True)
        self.serving = True
        self.arbiter.watch.remote()

    # ------------------------------------------------------------ training

    def allotment(self) -> int:
        """The arbiter's allotment; the last one heard once the arbiter is gone (a signal to the
        pool's whole process group, as `timeout` sends, ends Ray's workers with the driver)."""
        try:
            self.allotted = ray.get(self.arbiter.allotment.remote())
        except RayError:
            pass
        return self.allotted

    def follow_allotment(self) -> None:
        """While a run that restarts to resize trains: when the arbiter allots another size, ask it
        to checkpoint and stop (again each poll until it has: a launch starting deletes a notice
        left before it). An in-place group follows the allotment itself (launch's `allotment`)."""
        if self.job.scaling.resize == "in_place":
            return
        while not self.ended.wait(self.pool.policy.poll_interval_s):
            allotted = self.allotment()
            with self.lock:
                if allotted != self.size:
                    self.resize_asked = True
                    self.storage.write_bytes(f"resize to {allotted}".encode(), PREEMPT_FILE)

    def train(self) -> int:
        """Launch the run at its allotted size until it ends; each resize is a checkpoint and a launch."""
        began_at = None  # the first launch began with the command; each relaunch, when it is asked for
        while True:
            try:
                in_place = self.job.scaling.resize == "in_place"
                launch(at_size(self.job, self.size), began_at=began_at, allotment=self.allotment if in_place else None)
                return exit_codes.DONE
            except Preempted as err:
                with self.lock:
                    allotted = self.allotment()
                    if err.signalled or not self.resize_asked or self.serving_error is not None:
                        print(f"shardyard pool: {self.serving_error or err}", file=sys.stderr, flush=True)
                        return exit_codes.GAVE_UP if self.serving_error else exit_codes.PREEMPTED
                    print(f"shardyard pool: training resumes at {allotted} workers (from {self.size})", flush=True)
                    self.size, self.resize_asked, began_at = allotted, False, time.time()
            except RunGaveUp as err:
                print(f"shardyard: {err}", file=sys.stderr, flush=True)
                return exit_codes.GAVE_UP

    def run(self) -> int:
        threads = [threading.Thread(target=self.serve_when_ready, name="shardyard-pool-serving", daemon=True),
                   threading.Thread(target=self.follow_allotment, name="shardyard-pool-resizer", daemon=True)]
        for thread in threads:
            thread.start()
        try:
            return self.train()
        finally:
            self.ended.set()
            self.finish()

    def finish(self) -> None:
        try:
            timeline = ray.get(self.arbiter.timeline.remote())
            self.storage.write_bytes(json.dumps(timeline).encode(), *TIMELINE)
            self.arbiter.stop.remote()
            if self.serving:
                serve.delete(self.pool.serving.app)  # replicas finish the requests they hold
        except RayError as err:  # Ray's workers were stopped under the pool
            print(f"shardyard pool: the pool's Ray actors were stopped from outside ({type(err).__name__}): no "
                  f"timeline written", file=sys.stderr, flush=True)
        print(summary(read_events(self.job.run_uri)), flush=True)


def summary(events: list[dict[str, Any]]) -> str:
    """The pool's decisions and how long each took to take effect, as a table."""
    rows = [e for e in events if e["event"] in (Event.LEND, Event.LEND_SERVING, Event.RETURN, Event.RETURN_TRAINING)]
    if not rows:
        return "shardyard pool: no device changed hands"
    start = rows[0]["time"]
    lines = ["shardyard pool: what changed hands", f"{'t (s)':>7}  {'event':<16} detail"]
    for e in rows:
        if e["event"] in (Event.LEND, Event.RETURN):
            detail = f"training {e['from_workers']} -> {e['to_workers']} workers: {e['reason']}"
        elif e["event"] == Event.LEND_SERVING and e.get("wake"):
            detail = f"{e['replicas']} replica serves, woken from zero {e['since_decision_s']:.1f} s after the lend"
        elif e["event"] == Event.LEND_SERVING:
            detail = f"{e['replicas']} replicas serve, {e['since_breach_s']:.1f} s after the breach began"
        else:
            detail = f"training steps at {e['world_size']} workers, {e['since_decision_s']:.1f} s after the decision"
        lines.append(f"{e['time'] - start:7.1f}  {e['event']:<16} {detail}")
    return "\n".join(lines)


def run_pool(config: str, overrides: list[str]) -> int:
    """Validate everything, then run the pool. A bad spec is a message and exit code 2."""
    try:
        pool, job = load_pool(config, overrides)
        devices = connect(pool, job)
        with ray_console(job.run_uri, job.run.name):  # until Ray is left: see cli/train.py
            try:
                return Pool(pool, job, devices).run()
            finally:
                ray.shutdown()
    except SpecError as err:
        print(f"shardyard: {err}", file=sys.stderr)
        return exit_codes.REFUSED
    finally:
        if ray.is_initialized():
            ray.shutdown()
