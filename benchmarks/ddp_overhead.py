"""shardyard DDP on Ray Train vs plain torchrun DDP: same model, data, batch and steps.

Prints steady-state samples/s of each and their ratio (target: shardyard >= 0.95x), with
start-up time reported separately, and writes benchmarks/results/ddp_overhead.json.

    python benchmarks/ddp_overhead.py [--steps 80] [--workers 2]
"""

from __future__ import annotations

import argparse
import json

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import print_table, write_json

from shardyard.spec import load_spec
from shardyard.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "jobs" / "configs" / "gpt_ddp.yaml"


def overrides(steps: int, workers: int, storage: str) -> list[str]:
    # One checkpoint at the very end: the steady-state window below leaves it out.
    return [f"run.steps={steps}", f"scaling.num_workers={workers}", "run.log_every=5",
            f"checkpoint.every_n_steps={steps}", f"checkpoint.storage_path={storage}",
            "run.name=ddp_overhead", "optim.warmup_steps=0"]


def run_shardyard(args: argparse.Namespace, storage: str) -> dict:
    import ray

    from shardyard.train.launcher import launch

    spec = load_spec(CONFIG, overrides(args.steps, args.workers, storage))
    start = time.perf_counter()
    result = launch(spec)
    wall = time.perf_counter() - start
    ray.shutdown()
    rows = read_metrics(result.run_dir)
    # Steady state: drop the first interval (warm-up) and the last (it writes the checkpoint).
    steady = rows[1:-1]
    step_time = statistics.median(r["step_time_s"] for r in steady)
    return {"step_time_s": step_time, "wall_s": wall, "startup_s": wall - step_time * args.steps,
            "global_batch": spec.batch.global_batch_size}


def run_torchrun(args: argparse.Namespace, storage: str) -> dict:
    out = Path(storage) / "torchrun.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.workers}", str(REPO / "benchmarks" / "torchrun_ddp.py"),
               "--config", str(CONFIG), "--out", str(out)]
    for item in overrides(args.steps, args.workers, storage):
        command += ["--set", item]
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=REPO / "benchmarks")
    wall = time.perf_counter() - start
    times = json.loads(out.read_text())["step_times"]
    skip = max(1, len(times) // 10)  # warm-up steps
    step_time = statistics.median(times[skip:])
    return {"step_time_s": step_time, "wall_s": wall, "startup_s": wall - sum(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as storage:
        torchrun = run_torchrun(args, storage)
        shardyard = run_shardyard(args, storage)
    batch = shardyard.pop("global_batch")
    rows = []
    for name, r in (("torchrun DDP", torchrun), ("shardyard (Ray Train)", shardyard)):
        rows.append({"runner": name, "samples/s (steady)": batch / r["step_time_s"],
                     "step ms (median)": 1000 * r["step_time_s"], "start-up s": r["startup_s"],
                     "wall s": r["wall_s"]})
    ratio = rows[1]["samples/s (steady)"] / rows[0]["samples/s (steady)"]
    rows[1]["vs torchrun"] = ratio
    rows[0]["vs torchrun"] = 1.0
    print_table(f"DDP overhead: {args.workers} workers, {args.steps} steps, global batch {batch}", rows)
    print(f"\nsteady-state ratio shardyard/torchrun = {ratio:.3f} (target >= 0.95)")
    write_json("ddp_overhead", {"workers": args.workers, "steps": args.steps, "rows": rows,
                                "ratio": ratio, "target": 0.95, "meets_target": ratio >= 0.95})


if __name__ == "__main__":
    main()
