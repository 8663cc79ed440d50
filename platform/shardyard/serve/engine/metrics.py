"""The app's metrics, through Ray Serve's metrics API.

Each replica records; Ray's metrics agent on every node exports what its replicas recorded, each
series tagged with its application, deployment and replica, so one scrape covers every replica of
every app (a registry inside the replica would show whichever replica the proxy picked). Serve
already exports request counts, latency by route and status, its queue and its 503s
(`ray_serve_*`); these are what only the app sees: the decoding itself.

`GET /metrics` on the app answers with its own `ray_serve_*` and `ray_shardyard_*` series (those
labelled with its application) from every live node's export endpoint (Prometheus text), so a
user without a Prometheus server still sees them all, and nobody another app's. The agents publish every few seconds: a value appears there a little after it happened.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import ray
from ray.serve import metrics

from shardyard.serve.engine.decoding import PHASES, EngineStats

# Seconds: from a few milliseconds (a decode step on a GPU) to a long queue.
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
EXPORTED_PREFIXES = ("ray_serve_", "ray_shardyard_")
# Where a pool's arbiter (the actor replicas report their load to: `report_load_to`) is named.
ARBITER_NAMESPACE = "shardyard"


class ServingMetrics:
    def __init__(self) -> None:
        self.tokens = metrics.Counter("shardyard_generated_tokens", "tokens generated")
        self.rebuilds = metrics.Counter("shardyard_shard_group_rebuilds", "shard groups rebuilt after a shard died")
        # The engine (continuous batching).
        self.ttft = metrics.Histogram("shardyard_time_to_first_token_seconds", "arrival to first token",
                                      boundaries=LATENCY_BUCKETS)
        self.inter_token = metrics.Histogram("shardyard_inter_token_seconds", "between a request's tokens",
                                             boundaries=LATENCY_BUCKETS)
        self.running = metrics.Gauge("shardyard_running_requests", "requests decoding")
        self.waiting = metrics.Gauge("shardyard_waiting_requests", "requests waiting for a KV cache row")
        self.kv_blocks = metrics.Gauge("shardyard_kv_cache_blocks_used", "KV cache blocks held by running requests")
        self.kv_blocks_total = metrics.Gauge("shardyard_kv_cache_blocks", "KV cache blocks")
        self.served_step = metrics.Gauge("shardyard_served_step", "the training step of the weights answering "
                                                                  "(-1: a model directory, not a run's checkpoint)")
        self.promotions = metrics.Counter("shardyard_weight_swaps", "newer checkpoints of the run swapped in")
        self.promotions_refused = metrics.Counter("shardyard_weight_swaps_refused",
                                                  "checkpoints refused (weights not finite)")
        self.commit_to_serving = metrics.Gauge("shardyard_commit_to_serving_seconds",
                                               "the last swap: from the checkpoint's commit to serving it")
        self.prefix_hit_rate = metrics.Gauge("shardyard_prefix_cache_hit_rate",
                                             "share of prompt tokens found in the KV cache (prefix caching)")
        self.prefill_budget = metrics.Gauge("shardyard_prefill_token_budget", "prompt tokens one iteration may prefill")
        self.iterations = metrics.Counter("shardyard_engine_iterations", "iterations the engine ran")
        self.phase_seconds = metrics.Counter("shardyard_engine_phase_seconds", "the iterations' time by phase: "
                                             + ", ".join(PHASES) + " (serve/engine/decoding.py)", tag_keys=("phase",))
        # Static batches.
        self.queue = metrics.Histogram("shardyard_queue_seconds", "arrival to batch start", boundaries=LATENCY_BUCKETS)
        self.compute = metrics.Histogram("shardyard_batch_compute_seconds", "one batch's model time",
                                         boundaries=LATENCY_BUCKETS)
        self.batch_size = metrics.Histogram("shardyard_batch_size", "requests per batch",
                                            boundaries=[1, 2, 4, 8, 16, 32, 64, 128])
        self.max_batch_size = metrics.Gauge("shardyard_max_batch_size", "the batch size limit in force")
        # Ray exports a histogram's `_sum` as an estimate (each bucket's midpoint times its count:
        # a batch of 1 counts as 0.5), so the means people read get exact totals of their own,
        # to divide by the histograms' `_count`.
        self.queue_wait = metrics.Counter("shardyard_queue_wait_seconds", "every request's queue time, summed")
        self.batch_busy = metrics.Counter("shardyard_batch_busy_seconds", "every batch's model time, summed")
        self.batched = metrics.Counter("shardyard_batched_requests", "requests over all batches")
        # Every error response, those Serve never sees as errors (a 401 or 413 from the guard,
        # an unhandled exception answered 500) included; the route is a template, never a raw path.
        self.errors = metrics.Counter("shardyard_http_errors", "error responses by status and route",
                                      tag_keys=("status", "route"))
        # Before the engine: requests still sending their bodies, and those whole and waiting for
        # the engine's slots (the replica's queue, which Serve's own queue series do not count).
        self.pending_bodies = metrics.Gauge("shardyard_pending_bodies", "requests still sending their bodies")
        self.queued = metrics.Gauge("shardyard_queued_requests", "requests waiting for room in the engine")
        self._engine_tokens = 0
        self._engine_iterations = 0
        self._phases = dict.fromkeys(PHASES, 0.0)
        # What the engine reported last, as a pool's arbiter reads it (pool/load.py's ReplicaLoad).
        self.load: dict[str, Any] | None = None

    def batch_started(self, waits: list[float]) -> None:
        """A static batch begins: each request's time in the queue, and the batch's size."""
        for wait in waits:
            self.queue.observe(wait)
        self.batch_size.observe(len(waits))
        if waits:  # a Ray counter takes positive increments only
            self.queue_wait.inc(max(sum(waits), 1e-9))
            self.batched.inc(len(waits))

    def batch_finished(self, elapsed: float) -> None:
        self.compute.observe(elapsed)
        self.batch_busy.inc(max(elapsed, 1e-9))

    def admission(self, pending_bodies: int, queued: int) -> None:
        self.pending_bodies.set(pending_bodies)
        self.queued.set(queued)

    def count_error(self, status: int, route: str) -> None:
        self.errors.inc(tags={"status": str(status), "route": route})

    def read_engine(self, stats: EngineStats) -> None:
        """Bring in what the engine (built-in or vLLM) measured since the last call (it keeps
        plain numbers, so it runs without Ray in tests)."""
        ttft, stats.time_to_first_token_s = stats.time_to_first_token_s, []
        gaps, stats.inter_token_s = stats.inter_token_s, []
        for value in ttft:
            self.ttft.observe(value)
        for value in gaps:
            self.inter_token.observe(value)
        if stats.tokens > self._engine_tokens:
            self.tokens.inc(stats.tokens - self._engine_tokens)
            self._engine_tokens = stats.tokens
        if stats.iterations > self._engine_iterations:
            self.iterations.inc(stats.iterations - self._engine_iterations)
            self._engine_iterations = stats.iterations
        for phase, seconds in stats.phases.items():
            if seconds > self._phases[phase]:  # a Ray counter takes positive increments only
                self.phase_seconds.inc(seconds - self._phases[phase], tags={"phase": phase})
                self._phases[phase] = seconds
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_blocks.set(stats.cache_blocks_used)
        self.kv_blocks_total.set(stats.cache_blocks)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        self.prefill_budget.set(stats.prefill_budget)
        self.load = {"running": stats.running, "waiting": stats.waiting, "kv_blocks_used": stats.cache_blocks_used,
                     "kv_blocks": stats.cache_blocks, "ttft_s": ttft}


def scrape_cluster(app: str, timeout_s: float = 5.0) -> str:
    """This application's Serve and shardyard series from every live node's metrics export endpoint
    (each node's export holds every application's: another app's are not this app's clients' to read)."""
    lines: list[str] = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node["Alive"] or not port:
            continue
        try:
            with urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{port}/metrics", timeout=timeout_s) as r:
                lines += r.read().decode().splitlines()
        except OSError:  # a node going away: the others still answer
            continue
    return "\n".join(series_of(app, lines)) + "\n"


def series_of(app: str, lines: list[str]) -> list[str]:
    """The samples (Prometheus text) labelled with `app` of the exported prefixes, with the HELP
    and TYPE lines of their metrics."""
    label = f'application="{app}"'
    kept = {line for line in lines if line.startswith(EXPORTED_PREFIXES) and label in line.partition("} ")[0]}
    names = {line.partition("{")[0] for line in kept}

    def describes(line: str) -> bool:  # "# HELP <name> ..." or "# TYPE <name> <kind>" (a histogram's too)
        words = line.split(" ", 3)
        return len(words) > 2 and any(n == words[2] or n.startswith(words[2] + "_") for n in names)

    return [line for line in lines if line in kept or (line.startswith("# ") and describes(line))]
