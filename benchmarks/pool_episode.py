"""One episode of the elastic pool (`shardyard pool`): serving load rises past the SLO, training
lends a worker, a second replica serves; load falls, Serve lets the replica go, training takes the
device back. Side by side with the same pool under `priority: training` (the two fleets split
once: the run never shrinks), over the same load schedule, on two model shapes.

Measured: time to lend (the breach's start to the new replica serving, from the run's
`lend_serving` event), time to return (the decision to training at full size again,
`return_training`), the training samples the episode kept (against the static split's over the
same time), request latency per phase (calm, peak, after) and failed requests (any answer but
200). The load generator's clients each send one completion at a time.

    python benchmarks/pool_episode.py [--shapes tiny small] [--out docs/images/pool_episode.png] [--pool-only]

Each run prints a table, writes benchmarks/results/pool_episode.json and plots the first shape's
episode (load, replicas, training workers and throughput over time): into docs/images/ for the
full comparison, into the current directory for `--pool-only`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import print_table, write_json
from fake_cluster import wait_for
from shardyard.storage.events import read_events
from shardyard.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "jobs" / "configs" / "pool.yaml"
SHARDYARD = str(Path(sys.executable).with_name("shardyard"))
GLOBAL_BATCH = 48  # the episode job's; 4 steps an epoch of its 192 samples
SHAPES = {  # the GPT's layers and width, trained and served
    "tiny": ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32"],
    "small": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=64"],
}


@dataclass
class Load:
    """Clients sending completions one after another; `clients` may change while they run."""
    url: str
    clients: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)

    def start(self, most: int) -> None:
        for i in range(most):
            threading.Thread(target=self._client, args=(i,), daemon=True).start()

    def _client(self, index: int) -> None:
        body = json.dumps({"prompt": "def main():", "max_tokens": 16, "temperature": 0}).encode()
        while not self.stopped.is_set():
            if index >= self.clients:
                time.sleep(0.05)
                continue
            began = time.time()
            request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    status = answer.status
                    answer.read()
            except urllib.error.HTTPError as err:
                status = err.code
            except OSError:
                status = 0
            self.requests.append({"start": began, "end": time.time(), "status": status, "clients": self.clients})

    def served_since(self, t: float) -> int:
        return sum(1 for r in list(self.requests) if r["start"] >= t and r["status"] == 200)


def episode_job(storage: Path, name: str, shape: list[str]) -> list[str]:
    """The pool's training job: trained until stopped, on synthetic data (an epoch of 4 steps, so
    the sample ledger sees many), with plain SGD (what the test's oracle can check exactly)."""
    return [f"run.name={name}", f"checkpoint.storage_path={storage}", "run.steps=100000", "data.name=synthetic",
            "data.num_samples=192", f"batch.global_batch_size={GLOBAL_BATCH}", "batch.micro_batch_size=8",
            "checkpoint.every_n_steps=20", "checkpoint.keep=3", "run.log_every=10", "run.sample_ledger=true",
            "optim.name=sgd", "optim.grad_clip=0", "optim.schedule=constant", "optim.lr=0.02",
            "scaling.num_workers=null", "scaling.min_workers=1", "scaling.max_workers=2",
            "scaling.resources_per_worker={CPU: 0.5}", *shape]


def start_pool(storage: Path, name: str, shape: list[str], priority: str, port: int, signal_: str,
               above: float, cool_down_s: float, log: Path) -> subprocess.Popen:
    overrides = [f"training.set={json.dumps(episode_job(storage, name, shape))}", f"serving.port={port}",
                 f"policy.priority={priority}",
                 f"policy.lend_when.signal={signal_}", f"policy.lend_when.above={above}",
                 "policy.lend_when.for_s=2", f"policy.cool_down_s={cool_down_s}",
                 # One lend and one return, timed: the bounds against flapping (a breach as long as a
                 # resize, dwell, budget) would only add their waits (tests/pool/test_pool.py holds them).
                 "policy.resize_cost_s=0", "policy.min_dwell_s=0", "serving.args.autoscaling.downscale_delay_s=3",
                 "serving.args.autoscaling.upscale_delay_s=1", "serving.args.autoscaling.look_back_period_s=11", "serving.args.batching.max_batch_size=2"]
    command = [SHARDYARD, "pool", str(CONFIG)] + [a for o in overrides for a in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local instance with the pool's devices
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def event(run_dir: Path, kind: str, after: float = 0.0) -> dict[str, Any] | None:
    return next((e for e in read_events(run_dir) if e["event"] == kind and e["time"] >= after), None)


def stop(pool: subprocess.Popen, log: Path, timeout_s: float = 120) -> int:
    """SIGTERM: the run checkpoints and stops, the app is deleted."""
    pool.send_signal(signal.SIGTERM)
    try:
        return pool.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(pool.pid, signal.SIGKILL)
        raise TimeoutError(f"the pool did not stop on SIGTERM; see {log}") from None


def run_episode(storage: Path, name: str, shape: list[str], port: int = 8000, priority: str = "serving",
                schedule: dict[str, float] | None = None, peak_clients: int = 6, timeout_s: float = 300,
                signal_: str = "queue_length", above: float = 3.0, cool_down_s: float = 3.0,
                calm_s: float = 10.0, lent_s: float = 20.0) -> dict[str, Any]:
    """Run one episode; with `schedule` (phase lengths of an earlier episode), the same load by the
    clock instead of by the pool's events. The calm phase lasts at least `calm_s`, and the peak at
least `lent_s` once the lent replica serves (phase lengths for the figures, not for correctness).
    Returns the run directory, the phases, the requests and the app's /metrics text at the end."""
    log = storage / f"{name}.log"
    pool = start_pool(storage, name, shape, priority, port, signal_, above, cool_down_s, log)
    run_dir = storage / name
    load = Load(f"http://127.0.0.1:{port}/v1/completions")
    load.start(peak_clients)
    phases: dict[str, float] = {}
    shown = {"metrics": ""}

    def alive() -> None:
        if pool.poll() is not None:
            raise RuntimeError(f"the pool exited ({pool.returncode}); see {log}:\n{log.read_text()[-3000:]}")

    def until(condition: Any, message: str, limit: float = timeout_s) -> None:
        wait_for(lambda: alive() or condition(), limit, f"{message}; see {log}")

    try:
        until(lambda: event(run_dir, "first_step") and served(port), "serving never came up")
        phases["calm"] = time.time()
        load.clients = 1
        until(lambda: load.served_since(phases["calm"]) >= 5, "no request answered while calm")
        time.sleep(max(0.0, (schedule["calm"] if schedule else calm_s) - (time.time() - phases["calm"])))
        phases["peak"] = time.time()
        load.clients = peak_clients
        if schedule:
            time.sleep(schedule["lent"])
            phases["lent"] = time.time()
            time.sleep(schedule["peak"] - schedule["lent"])
        else:
            until(lambda: event(run_dir, "lend_serving"), "serving never got a lent device")
            phases["lent"] = time.time()
            until(lambda: load.served_since(phases["lent"]) >= 4 * peak_clients, "the lent replica answered nothing")
            time.sleep(max(0.0, lent_s - (time.time() - phases["lent"])))
        phases["after"] = time.time()
        load.clients = 1
        if schedule:
            time.sleep(schedule["after"])
        else:
            until(lambda: event(run_dir, "return_training"), "training never took its device back")
            # The app's metrics show both decisions (Ray exports them every few seconds).
            until(lambda: all(f"ray_shardyard_pool_{kind}" in scraped(port, shown) for kind in ("lends", "returns")),
                  "the app's metrics never showed the pool's", 60)
        phases["end"] = time.time()
    finally:
        load.stopped.set()
        code = stop(pool, log) if pool.poll() is None else pool.returncode
    return {"run_dir": run_dir, "phases": phases, "requests": load.requests, "exit_code": code, "log": log,
            "metrics": shown["metrics"]}


def scraped(port: int, into: dict[str, str]) -> str:
    """The app's /metrics text (kept in `into`), or "" while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            into["metrics"] = answer.read().decode()
    except OSError:
        return ""
    return into["metrics"]


def served(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def samples_between(run_dir: Path, t0: float, t1: float) -> int:
    """Samples trained between two times (the metrics log's rows: one every log_every steps)."""
    rows = [r for r in read_metrics(run_dir) if t0 <= r["time"] <= t1]
    return (max(r["step"] for r in rows) - min(r["step"] for r in rows)) * GLOBAL_BATCH if len(rows) > 1 else 0


def figures(episode: dict[str, Any]) -> dict[str, Any]:
    run_dir, p = episode["run_dir"], episode["phases"]
    events = read_events(run_dir)
    out: dict[str, Any] = {"failed_requests": sum(r["status"] != 200 for r in episode["requests"]),
                           "requests": len(episode["requests"])}
    for kind, key, measure in (("lend_serving", "time_to_lend_s", "since_breach_s"),
                               ("return_training", "time_to_return_s", "since_decision_s")):
        found = [e for e in events if e["event"] == kind]
        out[key] = found[0][measure] if found else None
    for phase, end in (("calm", "peak"), ("peak", "after"), ("lent", "after"), ("after", "end")):
        times = [r["end"] - r["start"] for r in episode["requests"] if p[phase] <= r["start"] < p[end]]
        out[f"{phase}_p50_ms"] = 1000 * percentile(times, 0.5) if times else None
        out[f"{phase}_p90_ms"] = 1000 * percentile(times, 0.9) if times else None
    out["samples_trained"] = samples_between(run_dir, p["calm"], p["end"])
    timeline = json.loads((run_dir / "pool" / "timeline.json").read_text())
    watched = [r for r in timeline if p["calm"] <= r["now"] <= p["end"]]
    out["training_down_s"] = sum(b["now"] - a["now"] for a, b in zip(watched, watched[1:]) if a["training_size"] is None)
    out["episode_s"] = p["end"] - p["calm"]
    return out


def plot(episode: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir, t0 = episode["run_dir"], episode["phases"]["calm"]
    timeline = json.loads((run_dir / "pool" / "timeline.json").read_text())
    rows = [r for r in timeline if r["now"] >= t0 - 5]
    t = [r["now"] - t0 for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    axes[0].plot(t, [r["signal"] or 0 for r in rows], label="queue per replica (arbiter's signal)")
    requests = episode["requests"]
    axes[0].scatter([r["start"] - t0 for r in requests], [r["end"] - r["start"] for r in requests], s=4,
                    color="tab:gray", label="request latency (s)")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[0].set_ylabel("load")
    axes[1].step(t, [r["replicas_running"] for r in rows], where="post", label="serving replicas running")
    axes[1].step(t, [r["training_size"] or 0 for r in rows], where="post", label="training workers (0: restarting)")
    axes[1].legend(loc="lower right", fontsize=8)
    axes[1].set_ylabel("devices")
    metrics = [m for m in read_metrics(run_dir) if m["time"] >= t0]
    rates = [(b["time"] - t0, (b["step"] - a["step"]) / (b["time"] - a["time"]))
             for a, b in zip(metrics, metrics[1:]) if b["time"] > a["time"] and b["step"] > a["step"]]
    axes[2].plot([x for x, _ in rates], [y for _, y in rates], marker=".", label="training steps/s")
    axes[2].set_ylabel("steps/s")
    axes[2].set_xlabel("seconds since the episode began")
    for ax in axes:
        for phase in ("peak", "lent", "after"):
            ax.axvline(episode["phases"][phase] - t0, color="tab:red", linestyle=":", linewidth=1)
    for e in read_events(run_dir):
        if e["event"] in ("lend", "return") and e["time"] >= t0:
            axes[1].annotate(e["event"], (e["time"] - t0, e["to_workers"]), fontsize=8)
    axes[0].set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path, help="the plot (default: docs/images/pool_episode.png, the docs' own; "
                        "with --pool-only pool_episode.png in the current directory)")
    parser.add_argument("--pool-only", action="store_true", help="one episode of the pool, without the static "
                        "split beside it (the first shape; about 2 minutes here)")
    args = parser.parse_args()
    if args.out is None:  # a quick look never overwrites the figure the docs show
        args.out = Path("pool_episode.png") if args.pool_only else ROOT / "docs" / "images" / "pool_episode.png"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            pooled = run_episode(Path(tmp), f"pool_{shape}", SHAPES[shape])
            if shape == args.shapes[0]:
                plot(pooled, args.out, f"one episode of the pool ({shape} GPT, 3 devices)")
            if args.pool_only:
                print_table("pool episode", [{"shape": shape, **figures(pooled)}])
                return
            p = pooled["phases"]
            schedule = {"calm": p["peak"] - p["calm"], "peak": p["after"] - p["peak"], "lent": p["lent"] - p["peak"],
                        "after": p["end"] - p["after"]}
            static = run_episode(Path(tmp), f"static_{shape}", SHAPES[shape], priority="training", schedule=schedule)
            a, b = figures(pooled), figures(static)
            rows.append({"shape": shape, "policy": "pool (serving first)", **a})
            rows.append({"shape": shape, "policy": "static split", **b})
            rows.append({"shape": shape, "policy": "pool / static", "peak_p90_ms": ratio(a["peak_p90_ms"], b["peak_p90_ms"]),
                         "lent_p90_ms": ratio(a["lent_p90_ms"], b["lent_p90_ms"]),
                         "samples_trained": ratio(a["samples_trained"], b["samples_trained"])})
    print_table("pool episode: lend under load, return after (ratios: pool over the static split)", rows)
    write_json("pool_episode", {"rows": rows})


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


if __name__ == "__main__":
    main()
