"""Load on the HTTP serving app: what batching and sharding buy, and how overload is answered.

For each app configuration (no batching, fixed batching, adaptive batching; 1, 2 and 4 pipeline
shards; 2 tensor shards) the app is deployed on a local Ray Serve and driven over HTTP:

- a closed-loop sweep: C clients each send a completion, wait for it, send the next;
- an open-loop sweep: Poisson arrivals at fractions of the closed-loop peak, up to 2x overload,
  where the bounded queue must answer the excess with 503 at once while accepted requests keep
  their latency.

Reported per point: throughput (requests/s and tokens/s), p50/p95/p99 latency of answered
requests, the count of each status code, the p99 latency of rejections, and from the server's own
Prometheus metrics the mean queue time per request, compute time per batch and batch size. Also
the per-hop cost of sharding: one forward pass with 1, 2 and 4 shards, outside HTTP. Targets:
batching >= 3x the throughput of no batching at equal or lower p95; under 2x overload,
rejections within 5 ms and accepted requests' p99 no worse than at the peak.

    python benchmarks/serve_load.py [--duration 5] [--configs none fixed adaptive ...]

The model is the default training job's GPT (jobs/configs/gpt_ddp.yaml), untrained: speed does
not depend on what the weights learned.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import ray
import torch
from ray import serve

from common import RESULTS, print_table, write_json
from shardyard.localdist import free_port, run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.spec import load_spec
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.layout import TrainState

CONFIG = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "gpt_ddp.yaml"
MAX_TOKENS = 16
BASE = {"batching.max_batch_size": 16, "limits.max_queued_requests": 16, "limits.request_timeout_s": 30.0}
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"batching": "none", "engine.num_shards": 1},
    "fixed": {"batching": "fixed", "engine.num_shards": 1, "batching.batch_wait_timeout_s": 0.01},
    "adaptive": {"batching": "adaptive", "engine.num_shards": 1},
    "fixed-pp2": {"batching": "fixed", "engine.num_shards": 2, "batching.batch_wait_timeout_s": 0.01},
    "fixed-pp4": {"batching": "fixed", "engine.num_shards": 4, "batching.batch_wait_timeout_s": 0.01},
    "fixed-tp2": {"batching": "fixed", "engine.num_shards": 2, "engine.sharding": "tensor",
                  "batching.batch_wait_timeout_s": 0.01},
}


def save_untrained(rank: int, world: int, out: str) -> None:
    spec = load_spec(CONFIG, ["scaling.num_workers=1"])
    torch.manual_seed(spec.run.seed)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    CheckpointManager(out, keep=1).save(engine, TrainState(0, 0, world), spec)


@contextlib.contextmanager
def local_serve() -> Iterator[tuple[int, str]]:
    """A local Ray with Serve on a free port, and the default job's GPT saved untrained:
    (the port, the checkpoint directory)."""
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_distributed(save_untrained, 1, tmp)
            yield port, str(Path(tmp, "checkpoint_step_00000000"))
    finally:
        serve.shutdown()
        ray.shutdown()


# ----------------------------------------------------------------------------- load generators

async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random) -> tuple[int, float]:
    body = {"prompt": "def " + "x" * rng.randrange(1, 24), "max_tokens": MAX_TOKENS}
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as answer:
            await answer.read()
            return answer.status, time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0, time.perf_counter() - start  # connection refused or dropped


async def closed_loop(url: str, concurrency: int, duration: float) -> list[tuple[int, float]]:
    results: list[tuple[int, float]] = []
    end = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(i: int) -> None:
            rng = random.Random(i)
            while time.perf_counter() < end:
                results.append(await one_request(session, url, rng))

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return results


async def open_loop(url: str, rate: float, duration: float) -> list[tuple[int, float]]:
    """Poisson arrivals at `rate` per second, whatever the answers take (no client waits)."""
    rng = random.Random(0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks, due = [], time.perf_counter()
        end = due + duration
        while (due := due + rng.expovariate(rate)) < end:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(session, url, rng)))
        return await asyncio.gather(*tasks)


# ----------------------------------------------------------------------------- measurement

# Each mean's exact total (a counter) and its count (the histogram's): Ray's export estimates a
# histogram's own `_sum` from its buckets' midpoints.
SERVER_MEANS = {"queue_seconds": "queue_wait_seconds_total", "batch_compute_seconds": "batch_busy_seconds_total",
                "batch_size": "batched_requests_total"}


def server_counters(base_url: str) -> dict[str, float]:
    """Exact totals and counts of the app's queue time, batch compute time and batch size, over
    every replica's series (Ray exports each metric as `ray_` + its name, labelled by replica)."""
    import requests

    text = requests.get(f"{base_url}/metrics", timeout=10).text

    def summed(series: str) -> float:
        return sum(float(v) for v in re.findall(rf"^ray_shardyard_{series}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    found = {}
    for name, total in SERVER_MEANS.items():
        found[f"{name}_sum"], found[f"{name}_count"] = summed(total), summed(f"{name}_count")
    return found


def counters_after(base_url: str, before: dict[str, float], results: list[tuple[int, float]],
                   timeout_s: float = 30.0) -> dict[str, float]:
    """The counters once Ray's metrics export holds every answered request of this point (each is
    queued once; the replicas' agents publish every few seconds), or after `timeout_s`."""
    answered = sum(1 for code, _ in results if code == 200)
    deadline = time.monotonic() + timeout_s
    while True:
        after = server_counters(base_url)
        if after["queue_seconds_count"] - before["queue_seconds_count"] >= answered or time.monotonic() > deadline:
            return after
        time.sleep(0.5)


def summarize(results: list[tuple[int, float]], duration: float, before: dict, after: dict) -> dict[str, Any]:
    ok = sorted(t for code, t in results if code == 200)
    rejected = sorted(t for code, t in results if code == 503)
    codes: dict[int, int] = {}
    for code, _ in results:
        codes[code] = codes.get(code, 0) + 1
    delta = {k: after[k] - before[k] for k in after}

    def mean(name: str) -> float | None:
        count = delta[f"{name}_count"]
        return delta[f"{name}_sum"] / count if count else None

    return {
        "req_per_s": len(ok) / duration,
        "tokens_per_s": len(ok) * MAX_TOKENS / duration,
        "p50_ms": percentile(ok, 50), "p95_ms": percentile(ok, 95), "p99_ms": percentile(ok, 99),
        "codes": " ".join(f"{c}:{n}" for c, n in sorted(codes.items())),
        "reject_p99_ms": percentile(rejected, 99),
        "queue_ms": _ms(mean("queue_seconds")), "batch_compute_ms": _ms(mean("batch_compute_seconds")),
        "mean_batch": mean("batch_size"),
    }


def percentile(sorted_times: list[float], q: float) -> float | None:
    if not sorted_times:
        return None
    return 1000 * sorted_times[min(len(sorted_times) - 1, int(q / 100 * len(sorted_times)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def sweep(name: str, args: dict[str, Any], checkpoint_dir: str, port: int, duration: float,
          concurrencies: list[int], overloads: list[float]) -> list[dict[str, Any]]:
    from shardyard.serve.app.deployment import build_app

    serve.run(build_app({"checkpoint": checkpoint_dir, **BASE, **args}), name=name, route_prefix=f"/{name}")
    base_url = f"http://127.0.0.1:{port}/{name}"
    url = f"{base_url}/v1/completions"
    asyncio.run(closed_loop(url, 4, 1.0))  # warm-up
    rows = []
    for concurrency in concurrencies:
        before = server_counters(base_url)
        results = asyncio.run(closed_loop(url, concurrency, duration))
        rows.append({"config": name, "load": f"closed c={concurrency}",
                     **summarize(results, duration, before, counters_after(base_url, before, results))})
        print_table(f"{name}: closed loop", rows[-1:])
    peak = max(r["req_per_s"] for r in rows)
    for factor in overloads:
        before = server_counters(base_url)
        results = asyncio.run(open_loop(url, factor * peak, duration))
        rows.append({"config": name, "load": f"poisson {factor:g}x peak ({factor * peak:.1f}/s)",
                     **summarize(results, duration, before, counters_after(base_url, before, results))})
        print_table(f"{name}: open loop", rows[-1:])
    serve.delete(name)
    return rows


def hop_costs(checkpoint_dir: str, repeats: int = 20) -> list[dict[str, Any]]:
    """One forward pass (batch 1, 32 tokens) through N shards, outside HTTP: what a hop costs,
    with pipeline hops as Ray tasks passing object references and as a compiled graph."""
    from shardyard.serve.executor.shards import ShardedModel

    rows = []
    tokens = torch.zeros((1, 32), dtype=torch.long)
    for sharding, transport in [("pipeline", "object refs"), ("pipeline", "compiled graph"),
                                ("tensor", "torch.distributed")]:
        for n in (1, 2, 4):
            model = ShardedModel(checkpoint_dir, n, sharding=sharding, compiled=transport == "compiled graph")
            try:
                model.forward(tokens)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    model.forward(tokens)
                    times.append(time.perf_counter() - start)
            finally:
                model.close()
            rows.append({"sharding": sharding, "transport": transport, "shards": n,
                         "forward_ms": 1000 * statistics.median(times)})
            if n > 1:
                one = rows[-2 if n == 2 else -3]["forward_ms"]  # the same transport with 1 shard
                rows[-1]["added_ms_per_extra_shard"] = (rows[-1]["forward_ms"] - one) / (n - 1)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        points = [(r["req_per_s"], r["p95_ms"]) for r in rows
                  if r["config"] == name and r["load"].startswith("closed") and r["p95_ms"] is not None]
        ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("p95 latency (ms)")
    ax.set_title(f"closed-loop sweep, {MAX_TOKENS} tokens per completion")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per load point")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--overload", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="open-loop arrival rates as multiples of the closed-loop peak")
    args = parser.parse_args()

    with local_serve() as (port, checkpoint_dir):
        rows = []
        for name in args.configs:
            rows += sweep(name, CONFIGS[name], checkpoint_dir, port, args.duration, args.concurrency, args.overload)
        hops = hop_costs(checkpoint_dir)

    print_table("serving under load (answered requests' latency; codes: status:count, 0 = no answer)", rows)
    print_table("cost of sharding (forward pass, batch 1, 32 tokens; added time per extra shard)", hops)
    summary = compare(rows)
    print_table("targets", summary)
    RESULTS.mkdir(exist_ok=True)
    plot(rows, RESULTS / "serve_load.png")
    write_json("serve_load", {"max_tokens": MAX_TOKENS, "duration_s": args.duration, "base_config": BASE,
                              "configs": {n: CONFIGS[n] for n in args.configs}, "rows": rows,
                              "hops": hops, "targets": summary})


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Batching vs none at each one's best closed-loop point; overload vs peak per config."""
    def best(name: str) -> dict[str, Any] | None:
        closed = [r for r in rows if r["config"] == name and r["load"].startswith("closed")]
        return max(closed, key=lambda r: r["req_per_s"]) if closed else None

    summary = []
    unbatched = best("none")
    for name in ("fixed", "adaptive"):
        batched = best(name)
        if unbatched and batched:
            summary.append({"target": f"{name} vs none: throughput >= 3x",
                            "measured": f"{batched['req_per_s'] / unbatched['req_per_s']:.2f}x",
                            "detail": f"p95 {batched['p95_ms']:.0f} ms vs {unbatched['p95_ms']:.0f} ms"})
    for name in dict.fromkeys(r["config"] for r in rows):
        over = [r for r in rows if r["config"] == name and r["load"].startswith("poisson 2x")]
        at_peak = [r for r in rows if r["config"] == name and r["load"].startswith("poisson 1x")]
        if over and at_peak:
            o, p = over[0], at_peak[0]
            summary.append({"target": f"{name} at 2x: rejections < 5 ms, accepted p99 kept",
                            "measured": f"reject p99 {o['reject_p99_ms'] or 0:.1f} ms",
                            "detail": f"accepted p99 {o['p99_ms'] or 0:.0f} ms vs {p['p99_ms'] or 0:.0f} ms at 1x"})
    return summary


if __name__ == "__main__":
    main()
