"""Recovery after a worker dies: time from the kill to the end of the first step completed after
the restore, split into detection (kill -> Ray Train records the failure), worker-group restart
(failure -> new group running), checkpoint load, and that first step (the sample ledger's first
commit line of the new worker group, written once the step is applied); plus the steps recomputed
(committed before the kill, after the checkpoint restored). For DDP, FSDP and ZeRO-2, checkpoint
every 10 and 50 steps.

The hot path (scaling.recovery=hot, DDP over TorchFT) is measured beside it: the survivors'
stall (kill -> the next step a replica commits), when the replacement has healed from a live
peer, and the steps lost (only a step in flight can be). So is an in-place group
(scaling.resize=in_place, DDP): the survivor's stall (kill -> its next committed step, in the
generation the driver formed without the lost worker), when the replacement joined (its
generation formed, its state copied from the survivor), and the steps lost.

The default GPT, 2 workers on a local Ray instance; one worker process is SIGKILLed from outside
once a checkpoint exists. Timings come from the run's own event log and sample ledger. Targets on
this machine: restart path under 30 s with at most one interval recomputed; hot path under 10 s
with at most one step.

Resizes driven by Ray's autoscaler (`autoscaled`, tests/helpers/fake_cluster.py and autoscaled.py): an elastic run (2
to 4 workers) on a cluster with room for 2 asks for 4, the autoscaler adds two nodes and the run
grows; one of them then gets a preemption notice (`ray drain-node`), the run checkpoints, the node
is reclaimed and the run goes on at 3; when the run ends the autoscaler removes the idle nodes.
Each step of that is timed: a grow from the last node's launch to training on it (the nodes'
launch counted from the run's start, when it asks), a drain from the run hearing the notice to
the committed checkpoint (the run is held until Ray Train's watcher has told the workers: the
notice itself reaches a run within that watcher's 5 s poll plus the run's 5 s probe), a shrink
from the reclaim to training without the node (Ray's failure detection of a node that vanished,
then a worker-group restart), and the idle nodes' removal from the run's end.

    python benchmarks/recovery.py [--intervals 10 50] [--strategies ddp fsdp zero2 hot autoscaled]
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray

from common import print_table, write_json
from shardyard.spec import load_spec
from shardyard.checkpoint.loaders import find_latest
from shardyard.train.launcher import launch
from shardyard.storage.events import read_events
from ddp_overhead import CONFIG
from helpers.autoscaled import elastic_job, measure_autoscaled


def run_and_kill(strategy: str, interval: int, storage: str) -> tuple[Path, float]:
    """Train, SIGKILL one worker once a checkpoint exists, wait for the run to finish."""
    name = f"{strategy}_{interval}"
    hot, in_place = strategy == "hot", strategy == "in_place"
    spec = load_spec(CONFIG, [f"parallelism.strategy={'ddp' if hot or in_place else strategy}",
                              f"scaling.recovery={'hot' if hot else 'restart'}",
                              f"scaling.resize={'in_place' if in_place else 'restart'}",
                              f"checkpoint.every_n_steps={interval}",
                              "run.steps=400", "run.log_every=50", "run.sample_ledger=true",
                              "scaling.max_failures=1", f"checkpoint.storage_path={storage}",
                              f"run.name={name}", "checkpoint.keep=2"])
    run_dir = Path(storage) / name
    runner = threading.Thread(target=launch, args=(spec,))
    runner.start()
    while not find_latest(run_dir) and runner.is_alive():
        time.sleep(0.05)
    time.sleep(interval * 0.05)  # land the kill somewhere inside the next interval
    worker = "GroupWorker" if in_place else "RayTrainWorker"
    victim = next(p for p in psutil.process_iter(["cmdline"])
                  if any(worker in part for part in (p.info["cmdline"] or [])))
    killed_at = time.time()
    victim.send_signal(signal.SIGKILL)
    runner.join()
    return run_dir, killed_at


def ledger_lines(run_dir: Path, pattern: str = "rank*.jsonl") -> list[dict]:
    return [json.loads(line) for path in (run_dir / "ledger").glob(pattern) for line in path.read_text().splitlines()]


def measure_hot(interval: int, storage: str) -> dict:
    run_dir, killed_at = run_and_kill("hot", interval, storage)
    events = read_events(run_dir)
    commits = [e for e in ledger_lines(run_dir) if e.get("commit")]
    before = max(e["step"] for e in commits if e["time"] < killed_at)
    after = min((e for e in commits if e["time"] > killed_at), key=lambda e: e["time"])
    healed = [e for e in events if e["event"] == "healed" and e["time"] > killed_at]
    return {
        "strategy": "hot (ddp)", "interval": interval,
        "stall s": after["time"] - killed_at,
        "healed after s": healed[0]["time"] - killed_at if healed else None,
        "total s": after["time"] - killed_at,
        "steps recomputed": max(0, before + 1 - after["step"]),
        "healed to step": healed[0]["to_step"] if healed else None,
    }


def measure_in_place(interval: int, storage: str) -> dict:
    run_dir, killed_at = run_and_kill("in_place", interval, storage)
    events = read_events(run_dir)
    commits = [e for e in ledger_lines(run_dir, "worker*.jsonl") if e.get("commit")]
    before = max(e["step"] for e in commits if e["time"] < killed_at)
    after = min((e for e in commits if e["time"] > killed_at), key=lambda e: e["time"])
    regroups = [e for e in events if e["event"] == "regrouped" and e["time"] > killed_at]
    rejoined = next((e for e in regroups if e["world_size"] == 2), None)
    return {
        "strategy": "in place (ddp)", "interval": interval,
        "stall s": after["time"] - killed_at,
        "total s": after["time"] - killed_at,
        "replacement joined after s": rejoined["time"] - killed_at if rejoined else None,
        "regroup s": max(e["seconds"] for e in regroups) if regroups else None,
        "steps recomputed": max(0, before + 1 - after["step"]),
    }


def measure(strategy: str, interval: int, storage: str) -> dict:
    if strategy == "hot":
        return measure_hot(interval, storage)
    if strategy == "in_place":
        return measure_in_place(interval, storage)
    run_dir, killed_at = run_and_kill(strategy, interval, storage)
    events = read_events(run_dir)
    failure = next(e for e in events if e["event"] == "failure")
    restart = [e for e in events if e["event"] == "start"][-1]
    commits = [e for e in ledger_lines(run_dir, "rank0.jsonl") if e.get("commit")]
    new_attempt = max(e["attempt"] for e in commits)
    before = [e for e in commits if e["attempt"] != new_attempt]
    after = [e for e in commits if e["attempt"] == new_attempt]
    group_up = restart["time"] - restart["restore_s"]
    return {
        "strategy": strategy, "interval": interval,
        "detect s": failure["time"] - killed_at,
        "restart s": group_up - failure["time"],
        "load s": restart["restore_s"],
        "first step s": after[0]["time"] - restart["time"],
        "total s": after[0]["time"] - killed_at,
        "steps recomputed": max(e["step"] for e in before) - restart["restored_step"],
        "restored from": restart["restored_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--intervals", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "zero2", "hot", "in_place", "autoscaled"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as storage:
        if "autoscaled" in args.strategies:  # its own cluster, before this process joins one
            resizes = measure_autoscaled(elastic_job(Path(storage)), Path(storage) / "autoscaled")
            print_table("Resizes driven by Ray's autoscaler (elastic 2 to 4 workers, default GPT)", resizes)
            write_json("recovery_autoscaled", {"rows": resizes})
        if args.strategies == ["autoscaled"]:
            return
        ray.init(address="local", num_cpus=4, include_dashboard=False)
        for strategy in [s for s in args.strategies if s != "autoscaled"]:
            for interval in args.intervals:
                rows.append(measure(strategy, interval, storage))
                print(rows[-1], flush=True)
    print_table("Recovery from one killed worker (2 workers, default GPT)", rows)
    restart = [r for r in rows if not r["strategy"].startswith(("hot", "in place"))]
    hot = [r for r in rows if r["strategy"].startswith("hot")]
    in_place = [r for r in rows if r["strategy"].startswith("in place")]
    ok = [r["total s"] < 30 and r["steps recomputed"] <= r["interval"] for r in restart]
    print(f"\nrestart path under 30 s with at most one interval recomputed: {sum(ok)}/{len(restart)}")
    ok_hot = [r["stall s"] < 10 and r["steps recomputed"] <= 1 for r in hot]
    print(f"hot path stall under 10 s with at most one step recomputed: {sum(ok_hot)}/{len(hot)}")
    ok_in_place = [r["stall s"] < 2 and r["steps recomputed"] <= 1 for r in in_place]
    print(f"in-place stall under 2 s with at most one step recomputed: {sum(ok_in_place)}/{len(in_place)}")
    write_json("recovery", {"rows": rows, "targets": {"restart_total_s": 30, "restart_recomputed": "<= interval",
                                                      "hot_stall_s": 10, "hot_recomputed": "<= 1",
                                                      "in_place_stall_s": 2, "in_place_recomputed": "<= 1"}})


if __name__ == "__main__":
    main()
