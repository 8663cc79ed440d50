"""The arbiter: one Ray actor that watches the serving app's load and the training run's size and
decides which side holds each device of the pool (pool/policy.py decides; this gathers what it
decides on and makes each decision known).

What it watches, once a second by default: the replicas' load reports (pool/load.py), Serve's
own view of the app (`serve.status()`: replicas running, starting, or waiting for resources), the
pool's free devices (`ray.available_resources()`), and the run's size from its event log. What it
makes known: each lend and return is an event in the run's log (`lend`, `return`, and when it took
effect, `lend_serving` and `return_training`), a metric of the app (`shardyard_pool_*`, beside
the app's own on /metrics) and a line on the pool's console. The pool's driver reads `allotment()`
and resizes the run to it (pool/command.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from typing import Any

import ray
from ray import serve
from ray.util import metrics

from shardyard.storage.events import Event, log_event, read_events
from shardyard.pool.load import LoadBook, ReplicaLoad
from shardyard.pool.policy import Arbitration, Decision, Observation
from shardyard.pool.spec import PoolSpec

# Serve's replica states that hold or wait for a device (STOPPING ones are on their way out).
WANTED_STATES = ("RUNNING", "STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION")
SERVING_DEPLOYMENT = "ModelServer"  # the app's replicas that decode (serve/app/deployment.py); the others hold no device


def arbiter_name(run_name: str) -> str:
    return f"shardyard-pool-{run_name}"


def training_size(events: list[dict[str, Any]]) -> int | None:
    """The run's world size while it trains: that of its newest worker group once it has taken a
    step, or that an in-place group changed to; None while it stops, restarts or has not begun."""
    size = starting = None
    for event in events:
        kind = event["event"]
        if kind == Event.START:
            starting = event["world_size"]
        elif kind == Event.FIRST_STEP:
            size = starting
        elif kind == Event.REGROUPED:
            size = starting = event["world_size"]
        elif kind in (Event.PREEMPTED, Event.LAUNCH, Event.FAILURE, Event.DRAIN_CHECKPOINT):
            size = starting = None
    return size


class Arbiter:
    def __init__(self, pool: dict[str, Any], run_uri: str, min_workers: int, max_workers: int,
                 start_workers: int) -> None:
        self.pool = PoolSpec.model_validate(pool)
        self.run_uri = run_uri
        self.app = self.pool.serving.app
        lend = self.pool.policy.lend_when
        self.loads = LoadBook(lend.for_s)
        self.arbitration = Arbitration(self.pool.policy, min_workers, max_workers, start_workers)
        self.lock = threading.Lock()
        self.rows: list[dict[str, Any]] = []
        # Decisions not yet in effect: each with when it was made, the replicas running then and
        # when the breach it answers began.
        self.pending: list[tuple[Decision, float, int, float]] = []
        tags = {"application": self.app}
        self.lends = metrics.Counter("shardyard_pool_lends", "devices training lent to serving", tag_keys=("application",))
        self.returns = metrics.Counter("shardyard_pool_returns", "devices serving gave back to training",
                                       tag_keys=("application",))
        self.workers = metrics.Gauge("shardyard_pool_training_workers", "the world size the run is allotted",
                                     tag_keys=("application",))
        self.lent = metrics.Gauge("shardyard_pool_lent_devices", "devices lent to serving now", tag_keys=("application",))
        for gauge in (self.workers, self.lent):
            gauge.set_default_tags(tags)
        for counter in (self.lends, self.returns):
            counter.set_default_tags(tags)
        self.workers.set(start_workers)
        self.lent.set(0)
        self.watching = threading.Event()
        self.stopped = threading.Event()
        threading.Thread(target=self._loop, name="shardyard-arbiter", daemon=True).start()

    # ------------------------------------------------------------ called by replicas and the driver

    def report_load(self, replica: str, load: dict[str, Any]) -> None:
        with self.lock:
            self.loads.report(replica, ReplicaLoad(**load), time.time())

    def allotment(self) -> int:
        return self.arbitration.allotment

    def watch(self) -> None:
        """Serving is up: from now on the arbiter decides."""
        self.watching.set()

    def timeline(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.rows)

    def stop(self) -> None:
        self.stopped.set()

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self.stopped.wait(self.pool.policy.poll_interval_s):
            if self.watching.is_set():
                try:
                    self._tick()
                except Exception as err:  # a status call that failed: looked at again next tick
                    print(f"shardyard pool: arbiter: {type(err).__name__}: {err}", flush=True)

    def _serve_replicas(self) -> tuple[int, int]:
        """The app's model replicas (its ModelServer deployment): running, and wanted."""
        app = serve.status().applications.get(self.app)
        deployment = app.deployments.get(SERVING_DEPLOYMENT) if app is not None else None
        if deployment is None:
            return 0, 0
        states = {str(getattr(state, "value", state)): n for state, n in deployment.replica_states.items()}
        return states.get("RUNNING", 0), sum(states.get(s, 0) for s in WANTED_STATES)

    def _tick(self) -> None:
        now = time.time()
        running, wanted = self._serve_replicas()
        resource = self.pool.pool.resource
        free, devices = ray.available_resources().get(resource, 0.0), ray.cluster_resources().get(resource, 0.0)
        size = training_size(read_events(self.run_uri))
        with self.lock:
            signal = self.loads.signal(self.pool.policy.lend_when.signal, now)
        observation = Observation(now, signal, running, wanted, free, size, devices)
        decision = self.arbitration.observe(observation)
        with self.lock:
            self.rows.append({**asdict(observation), "allotment": self.arbitration.allotment,
                              "decision": decision.kind if decision else None})
        if decision is not None:
            self._announce(decision, signal, running)
        self._follow_up(observation)

    def _announce(self, decision: Decision, signal: float | None, running: int) -> None:
        log_event(self.run_uri, decision.kind, from_workers=decision.from_workers, to_workers=decision.to_workers,
                  reason=decision.reason, signal=signal, breach_since=self.arbitration.breach_since, wake=decision.wake)
        (self.lends if decision.kind == Event.LEND else self.returns).inc()
        self.workers.set(decision.to_workers)
        self.lent.set(self.arbitration.lent)
        what = "lends a device to serving" if decision.kind == Event.LEND else "takes a device back from serving"
        print(f"shardyard pool: training {what} ({decision.reason}): {decision.from_workers} -> "
              f"{decision.to_workers} workers", flush=True)
        now = time.time()
        self.pending.append((decision, now, running, self.arbitration.breach_since or now))

    def _follow_up(self, o: Observation) -> None:
        """Log when a decision took effect: a lent device serving (one more replica running), a
        returned one training (the run stepping at its new size)."""
        for item in list(self.pending):
            decision, at, running_then, breach_began = item
            if decision.kind == Event.LEND and o.replicas_running > running_then:
                log_event(self.run_uri, Event.LEND_SERVING, replicas=o.replicas_running, since_decision_s=o.now - at,
                          since_breach_s=o.now - breach_began, wake=decision.wake)
            elif decision.kind == Event.RETURN and o.training_size == decision.to_workers:
                log_event(self.run_uri, Event.RETURN_TRAINING, world_size=decision.to_workers, since_decision_s=o.now - at)
            else:
                continue
            self.pending.remove(item)


RemoteArbiter = ray.remote(num_cpus=0, max_concurrency=8)(Arbiter)
