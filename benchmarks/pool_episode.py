"""One episode of the elastic pool (`shardyard pool`): serving load rises past the SLO, training
lends a worker, a second replica serves; load falls, Serve lets the replica go, training takes the
device back. Three pools side by side over the same load schedule, on two model shapes: the run
resized in place (`scaling.resize: in_place`, jobs/configs/pool.yaml's: a worker leaves, one
joins), the run resized by a checkpoint and a restart (`scaling.resize: restart`), and the static
split (`priority: training`: the two fleets split once, the run never shrinks).

Measured: time to lend (the breach's start to the new replica serving, from the run's
`lend_serving` event), each decision to training at the new size (the lend's and the return's),
how long the in-place group took to change (its `regrouped` events), the training samples the
episode kept (against the static split's over the same time), request latency per phase (calm,
peak, after) and failed requests (any answer but 200). The load generator's clients each send one
completion at a time.

    python benchmarks/pool_episode.py [--shapes tiny small] [--out docs/images/pool_episode.png] [--pool-only]

Each run prints a table, writes benchmarks/results/pool_episode.json and plots the first shape's
episode (load, replicas, training workers and throughput over time): into docs/images/ for the
full comparison, into the current directory for `--pool-only`.

    python benchmarks/pool_episode.py --from-zero [--shapes tiny small]

Serving down to zero instead (benchmarks/results/pool_wake.json): an app at no replica, training
on every device, woken twice by a streamed request; beside it, the same app woken on a device no
one holds (Serve's own cold start, nothing lent), and the replica once awake. Measured: the first
token's time after zero, and where it went: Serve asking for a replica and the arbiter lending
(request to lend), the run's worker leaving (the lend to training at its new size), the replica
starting (the lend to the replica serving); and the return (decision to training at full size).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from common import print_table, write_json
from shardyard.pool.arbiter import training_size
from shardyard.storage.events import read_events
from shardyard.train.metrics import read_metrics
from helpers.repo import REPO
from helpers.pool_episode import FREE_DEVICE, FROM_ZERO, GLOBAL_BATCH, SHAPES, run_episode, run_wakes


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
    found = [e for e in events if e["event"] == "lend_serving"]
    out["time_to_lend_s"] = found[0]["since_breach_s"] if found else None
    for kind in ("lend", "return"):
        out[f"{kind}_to_training_s"] = to_new_size(events, kind)
    regroups = [e for e in events if e["event"] == "regrouped"]
    out["regroup_s"] = max(e["seconds"] for e in regroups) if regroups else None
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


def to_new_size(events: list[dict[str, Any]], kind: str) -> float | None:
    """Seconds from the first `kind` decision (lend, return) to the run training at the size it
    names, as the pool's arbiter reads the run's size from its events."""
    at = next((i for i, e in enumerate(events) if e["event"] == kind), None)
    if at is None:
        return None
    wanted = events[at]["to_workers"]
    for i in range(at + 1, len(events)):
        if training_size(events[:i + 1]) == wanted:
            return events[i]["time"] - events[at]["time"]
    return None


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


def wake_rows(wakes: dict[str, Any], shape: str, device: str) -> list[dict[str, Any]]:
    """One row a request: its first token's time and, for a request that woke the app on a lent
    device, the steps between."""
    events = read_events(wakes["run_dir"])
    rows = []
    for r in wakes["requests"]:
        row = {"shape": shape, "woken on": "(awake)" if r["warm"] else device, "wake": r["wake"] + 1,
               "status": r["status"], "first_token_s": r["first_token_s"]}
        lend = next((e for e in events if e["event"] == "lend" and e["time"] >= r["start"]), None)
        if not r["warm"] and lend is not None and lend["time"] <= r["end"]:
            after = [e for e in events if e["time"] >= lend["time"]]
            regrouped = next(e for e in after if e["event"] == "regrouped")
            serving = next(e for e in after if e["event"] == "lend_serving")
            back = next((e for e in after if e["event"] == "return"), None)
            row.update(request_to_lend_s=lend["time"] - r["start"], lend_to_training_s=regrouped["time"] - lend["time"],
                       lend_to_serving_s=serving["since_decision_s"],
                       return_to_training_s=to_new_size([e for e in after if e["time"] >= back["time"]], "return")
                       if back else None)
        rows.append(row)
    return rows


def from_zero(shapes: list[str]) -> None:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            lent = run_wakes(Path(tmp), f"zero_{shape}", SHAPES[shape])
            free = run_wakes(Path(tmp), f"free_{shape}", SHAPES[shape], wakes=1, pool_overrides=FREE_DEVICE)
            rows += wake_rows(lent, shape, "a lent device") + wake_rows(free, shape, "a free device")
    print_table("serving down to zero: a streamed request's first token after zero (seconds)", rows)
    write_json("pool_wake", {"rows": rows, "pools": {"lent": list(FROM_ZERO), "free": list(FREE_DEVICE)}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path, help="the plot (default: docs/images/pool_episode.png, the docs' own; "
                        "with --pool-only pool_episode.png in the current directory)")
    parser.add_argument("--pool-only", action="store_true", help="one episode of the pool, without the static "
                        "split beside it (the first shape; about 2 minutes here)")
    parser.add_argument("--from-zero", action="store_true", help="serving down to zero: the first token's time "
                        "after zero on a lent device and on a free one (about 3 minutes a shape here)")
    args = parser.parse_args()
    if args.from_zero:
        from_zero(args.shapes)
        return
    if args.out is None:  # a quick look never overwrites the figure the docs show
        args.out = Path("pool_episode.png") if args.pool_only else REPO / "docs" / "images" / "pool_episode.png"
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
            restarted = run_episode(Path(tmp), f"restart_{shape}", SHAPES[shape], schedule=schedule, resize="restart")
            static = run_episode(Path(tmp), f"static_{shape}", SHAPES[shape], priority="training", schedule=schedule)
            a, r, b = figures(pooled), figures(restarted), figures(static)
            rows.append({"shape": shape, "policy": "pool, in place", **a})
            rows.append({"shape": shape, "policy": "pool, restart", **r})
            rows.append({"shape": shape, "policy": "static split", **b})
            for name, x in (("in place", a), ("restart", r)):
                rows.append({"shape": shape, "policy": f"{name} / static",
                             "peak_p90_ms": ratio(x["peak_p90_ms"], b["peak_p90_ms"]),
                             "lent_p90_ms": ratio(x["lent_p90_ms"], b["lent_p90_ms"]),
                             "samples_trained": ratio(x["samples_trained"], b["samples_trained"])})
    print_table("pool episode: lend under load, return after (ratios: pool over the static split)", rows)
    write_json("pool_episode", {"rows": rows})


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


if __name__ == "__main__":
    main()
