"""The Serve application: one deployment (`ModelServer`, a FastAPI ingress) per app, which only
composes what a replica is made of and hands Ray Serve its hooks:

- the engine backend that decodes (serve/engine/backend.py): the built-in engine (serve/engine/builtin.py)
  or vLLM (serve/engine/vllm_engine.py); none for an MLP, answered whole by the replica;
- the HTTP surface: the guard in front of everything (auth, body limits, one error shape:
  serve/http/guard.py), OpenAI's routes with /healthz and /metrics (serve/http/openai_routes.py), the
  operator's routes (serve/http/admin_routes.py);
- following a run (`follow`): the weight gate (serve/follow/gate.py) and the follower
  (serve/follow/follower.py), with the app-wide AppWeights and, with a canary, the Rollout
  deployments (serve/follow/app_weights.py, serve/follow/rollout.py);
- the task that keeps the replica's gauges current (serve/engine/metrics.py).

Every mistake a client can make gets a 4xx in OpenAI's error shape with a reason (the routes'
modules list them). A request whose body is whole waits in the replica's queue until its choices
fit beside those the replica is answering (its concurrency counts choices, not requests); a full
queue (`limits.max_queued_requests`) or a wait past `limits.request_timeout_s` is answered 503 with Retry-After.
"""

import asyncio
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.handle import DeploymentHandle

from shardyard.checkpoint.layout import serving_spec
from shardyard.checkpoint.loaders import load_model
from shardyard.serve.http.admin_routes import Admin
from shardyard.serve.follow.app_weights import AppWeights, starting_checkpoint
from shardyard.serve.engine.backend import EngineBackend
from shardyard.serve.engine.builtin import REPLICA_CPUS, BuiltinEngine
from shardyard.serve.engine.core_client import EngineCoreClient, decodes_in_core, replica_bundles
from shardyard.serve.config import parse_config
from shardyard.serve.http.guard import GuardSettings
from shardyard.serve.http.surface import http_app
from shardyard.serve.app.ingress import header_deadline_s
from shardyard.serve.engine.metrics import ARBITER_NAMESPACE, ServingMetrics, scrape_cluster
from shardyard.serve.http.openai_routes import Answering
from shardyard.serve.executor.precision import serving_dtype
from shardyard.serve.follow.rollout import Rollout
from shardyard.serve.executor.placement import check_room, shard_bundle, uses_gpus
from shardyard.serve.engine.vllm_engine import start_vllm
from shardyard.serve.follow.follower import WeightFollower
from shardyard.serve.follow.gate import WeightGate, served_at_start
from shardyard.serve.resolved import ResolvedConfig, resolve
from shardyard.spec import LANGUAGE_MODELS, SpecError

# Ray starts its workers at niceness 15 (its `worker_niceness`), below its own daemons and every
# other process at 0. vLLM's engine runs a pass on OpenMP threads, one per core, that wait for each
# other at every operation, so any process at 0 waking on a core stalled the whole pass: a replica
# whose engine is vLLM runs at 0 (Ray's job supervisor does the same for job drivers), and vLLM's
# engine and workers, its children, inherit it. The built-in engine's replica stays at 15: at 0 it
# took the cores from Serve's proxy, which Ray keeps at 15 (docs/benchmarks.md, "Serving against
# vLLM", has both measurements).
SERVING_PRIORITY = {"env_vars": {"RAY_worker_niceness": "0"}}
# How often an app that scales to zero reports its load to Serve (see woken_promptly).
ZERO_METRICS_INTERVAL_S = 1.0
# How often the replica re-publishes its gauges: Ray's exporter drops a gauge not set lately.
PUBLISH_EVERY_S = 1.0


class Remote:
    """A deployment's methods as coroutines: `await Remote(handle).look(...)` is
    `await handle.look.remote(...)` (the follower takes any object with coroutine methods)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        return lambda *args: method.remote(*args)


def served_config(args: dict[str, Any]) -> ResolvedConfig:
    """`args` validated, then read against the checkpoint on the devices the cluster gives it."""
    config = parse_config(args)
    return resolve(config, uses_gpus(config.engine.device, config.engine.num_shards))


async def start_engine(cfg: ResolvedConfig, source: str, spec: Any, metrics: ServingMetrics) -> EngineBackend:
    """vLLM where asked for and able to serve the model, else the built-in engine (saying why):
    continuous batching in an engine core of the replica's own, static batches in the replica."""
    if decodes_in_core(cfg):
        client = EngineCoreClient(cfg, source, spec.block_size)
        await client.start()
        return client
    if cfg.engine.backend == "vllm":
        started = start_vllm(cfg, spec.block_size, serving_dtype(cfg.engine.dtype, cfg.use_gpu, cfg.checkpoint))
        if not isinstance(started, str):
            started.weights = cfg.fingerprint
            return started
        print(f"shardyard: engine: vllm asked for, the built-in engine serves: {started}", flush=True)
    return BuiltinEngine(cfg, source, spec, cfg.fingerprint, metrics=metrics)


# Everything ModelServer uses must be defined above it: Serve pickles the class when it is decorated.
@serve.deployment
@serve.ingress()  # each replica builds its own app (__serve_build_asgi_app__)
class ModelServer:
    async def __init__(self, config: dict[str, Any], rollout: DeploymentHandle | None = None,
                       app_weights: DeploymentHandle | None = None) -> None:
        """`rollout`: the app's Rollout deployment, with canary_fraction (serve/follow/rollout.py);
        `app_weights`: its AppWeights, following a run (serve/follow/app_weights.py). Following a run, a
        replica starts on the weights the app serves (those it promoted last), not on the run's
        newest checkpoint, which may be refused, on trial, or passed over by an operator."""
        cfg = served_config(config)
        replica = serve.get_replica_context().replica_id.unique_id
        if app_weights is not None:
            start = starting_checkpoint(await app_weights.look.remote(replica, ""), cfg.source)
            if start is not None:
                cfg = cfg.starting_at(start)
            await app_weights.promote.remote(Path(cfg.checkpoint))
        self.config, self.rollout, self.replica = cfg, rollout, replica
        self.metrics = ServingMetrics()
        scrape = partial(scrape_cluster, serve.get_replica_context().app_name)
        headers = header_deadline_s()
        print("shardyard: request headers " + (f"not received within {headers} s get 408 (Serve's HAProxy ingress)"
              if headers else "have no receive deadline here (Serve's default proxy: see docs/serving.md)"), flush=True)
        self._tasks: list[asyncio.Task] = []
        self.guard: GuardSettings | None = None  # made with the HTTP app
        spec = serving_spec(cfg.checkpoint).model
        served = served_at_start(cfg)
        self.engine: EngineBackend | None = None
        self.follower: WeightFollower | None = None
        if isinstance(spec, LANGUAGE_MODELS):
            # Following a run, the checkpoint resolved at start (a rebuild loads the weights the
            # gate let through, never a newer checkpoint unchecked); else the checkpoint as given.
            self.engine = await start_engine(cfg, cfg.checkpoint if cfg.following else cfg.source, spec, self.metrics)
            self.answering = Answering(cfg, spec.name, spec.block_size, spec.vocab_size, self.engine, served,
                                       scrape)
            if app_weights is not None:
                gate = WeightGate(cfg, self.engine, served, self.metrics)
                self.follower = WeightFollower(cfg, gate, Remote(app_weights),
                                               None if rollout is None else Remote(rollout), replica, self.metrics)
        else:  # the MLP: small, served whole by the replica
            self.answering = Answering(cfg, spec.name, 0, 0, None, served, scrape,
                                       mlp=load_model(cfg.checkpoint, cfg.trust_factory).eval(), in_dim=spec.in_dim)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The replica's HTTP app, over its own parts (Serve calls this once the replica is made)."""
        cfg = self.config
        limits = cfg.limits
        guard = GuardSettings(limits.max_body_bytes, cfg.bearer_token, limits.body_timeout_s, self.metrics.count_error,
                              self.start_tasks, cfg.admin_token, max_pending_bodies=limits.max_pending_bodies)
        self.guard = guard
        return http_app(guard, self.answering, Admin(self.follower))

    def __del__(self) -> None:
        """Serve calls this as it stops the replica: the engine's processes go with it (vLLM's, or
        the engine core, whose end is then not taken for a crash to recover from)."""
        if getattr(self, "engine", None) is not None:
            self.engine.close()

    def start_tasks(self) -> None:
        """Start (once, on the replica's event loop, from a request's guard or Serve's health
        check, whichever comes first) the task that keeps the gauges current and, serving a run
        with `follow`, the one that follows it."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._publish()))
        if self.follower is not None:
            self._tasks.append(loop.create_task(self.follower.run()))

    async def _publish(self) -> None:
        served = self.answering.served
        arbiter = None
        arbiter_name = self.config.config.report_load_to
        if arbiter_name is not None:
            try:
                arbiter = ray.get_actor(arbiter_name, namespace=ARBITER_NAMESPACE)
            except ValueError:  # no such actor: the gauges are still published
                print(f"shardyard: no pool arbiter named {arbiter_name!r}: this replica's load "
                      f"goes to its metrics only", flush=True)
        while True:
            if self.rollout is not None:  # what this replica's answers cost, for the canary's verdict
                tallies = {weights: replace(tally) for weights, tally in self.answering.tally.items()}
                await self.rollout.report.remote(self.replica, served.fingerprint, tallies)
            self.metrics.served_step.set(-1 if served.step is None else served.step)
            self.metrics.admission(len(self.guard.pending_bodies) if self.guard else 0, self.answering.choices.waiting)
            if self.engine is not None:
                await self.engine.report(self.metrics)
            if arbiter is not None and self.metrics.load is not None:
                arbiter.report_load.remote(self.replica, self.metrics.load)  # no answer awaited
            await asyncio.sleep(PUBLISH_EVERY_S)

    async def check_health(self) -> None:
        """Serve's periodic health check: a dead shard gets the whole group rebuilt, a dead engine
        core is replaced; only what cannot be fails the replica (Serve then replaces it)."""
        self.start_tasks()
        if self.engine is not None:
            await self.engine.heal()


def _describe(bundle: dict[str, float]) -> str:
    return f"{bundle['CPU']:g} CPU" + "".join(f" and {n:g} {name}" for name, n in bundle.items() if name != "CPU")


def _check_room(bundles: list[dict[str, float]], cfg: Any, what: str) -> None:
    """A replica no node can hold would leave the app waiting forever: refuse it before."""
    try:
        check_room(bundles, cfg.engine.multi_node, what)
    except ValueError as err:
        raise SpecError(f"invalid serve config: {err}") from None


def woken_promptly(autoscaling: dict[str, Any]) -> dict[str, Any]:
    """Serve's autoscaling options; an app that scales to zero hears of a request within a second.
    Serve's router tells its controller of a request waiting at zero replicas at once, but with the
    queue it last sampled (before that request), so Serve asks for a replica only at the router's
    next report, `metrics_interval_s` later (10 s by default): a request at zero waited that long
    before anything started."""
    if autoscaling.get("min_replicas", 1) == 0 and "metrics_interval_s" not in autoscaling:
        # Under look_back_period_s, as Serve requires.
        interval = min(ZERO_METRICS_INTERVAL_S, autoscaling.get("look_back_period_s", 30.0) / 2)
        return {**autoscaling, "metrics_interval_s": interval}
    return autoscaling


def build_app(args: dict[str, Any]) -> "serve.Application":
    """The Serve application for `args` (ServeConfig keys), validated before anything starts."""
    cfg = served_config(args)
    engine = cfg.engine
    generates = isinstance(serving_spec(cfg.checkpoint).model, LANGUAGE_MODELS)
    slots = cfg.concurrency + cfg.limits.max_queued_requests + cfg.limits.max_pending_bodies
    options: dict[str, Any] = dict(
        # Serve counts a request from its first byte: its slots cover the engine's choices, the
        # replica's own queue (after the body is whole: ChoiceLimit) and every body still arriving
        # (which displace each other past max_pending_bodies: guard.py), so trickled bodies never
        # hold a slot a request whose body is in needs. Serve's router queues every request it has
        # not placed yet (a burst's too, while it asks the replicas their load): as many again.
        max_ongoing_requests=slots,
        max_queued_requests=slots,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        graceful_shutdown_timeout_s=cfg.config.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": REPLICA_CPUS},
    )
    if cfg.config.autoscaling is None:
        options["num_replicas"] = cfg.config.num_replicas or 1
    else:  # Serve's options as given; by default it scales on requests in flight, a replica busy at one full batch
        options["autoscaling_config"] = {"target_ongoing_requests": cfg.batching.max_batch_size,
                                         **woken_promptly(cfg.config.autoscaling)}
    if generates and (decodes_in_core(cfg) or engine.num_shards > 1):
        # The replica's own bundle, then the model's (its engine core's, or one per shard): Serve
        # reserves them together.
        bundles = replica_bundles(cfg)
        _check_room(bundles, cfg, "a replica (" + " + ".join(_describe(bundle) for bundle in bundles) + ")")
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = "PACK" if engine.multi_node else "STRICT_PACK"
    elif generates:  # the model in the replica: the replica holds its shard's bundle
        bundle = {**shard_bundle(cfg.use_gpu, REPLICA_CPUS + engine.cpus_per_shard), **engine.device_resources}
        _check_room([bundle], cfg, f"a replica decoding in its own process ({_describe(bundle)})")
        options["ray_actor_options"] = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0.0),
                                        "resources": engine.device_resources}
    if engine.backend == "vllm":
        options["ray_actor_options"]["runtime_env"] = SERVING_PRIORITY
    # The checkpoint as given: a replica started later (autoscaling, a replacement) loads the
    # run's newest committed checkpoint then, or, following the run, the weights the app serves.
    rollout = None if cfg.canary is None else Rollout.bind(cfg.canary)
    app_weights = AppWeights.bind() if cfg.following else None
    return ModelServer.options(**options).bind(cfg.arguments(), rollout, app_weights)
