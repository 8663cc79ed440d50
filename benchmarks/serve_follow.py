"""New weights while serving: the app following its run (a hot swap between engine iterations)
against what Ray Serve offers without it (deploying the app again with the new checkpoint, which
replaces the replica), side by side under the same steady load.

For each way, C clients stream greedy completions back to back while checkpoints of the run are
committed one after another (the default job's GPT, each step's weights drawn from its own
seed). Reported: the time from each commit to the first answer made by its weights (read from
`system_fingerprint`), the latency of requests that overlapped a change against those that did
not (p50 and p99), and the requests that failed. Target: the hot swap's p99 during a swap within
1.5x of its p99 without one, and no failed request.

    python benchmarks/serve_follow.py [--clients 4] [--swaps 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
from ray import serve

from common import print_table, write_json
from serve_load import local_serve, percentile
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.record import checkpoint_name
from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.spec import load_spec

import torch

CONFIG = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "gpt_ddp.yaml"
APP = {"engine.num_shards": 2, "engine.cpus_per_shard": 0.5, "batching.max_batch_size": 8, "limits.request_timeout_s": 60}


def commit_checkpoint(rank: int, world: int, run_dir: str, step: int) -> None:
    spec = load_spec(CONFIG)
    torch.manual_seed(step)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    CheckpointManager(run_dir, keep=2).save(engine, TrainState(step, 0, world), spec)


class Load(threading.Thread):
    """One client streaming greedy completions back to back: (start, end, status, fingerprint)."""

    def __init__(self, url: str, index: int) -> None:
        super().__init__(daemon=True)
        self.url, self.index, self.stop, self.done = url, index, threading.Event(), []

    def run(self) -> None:
        body = {"prompt": f"def f{self.index}(", "max_tokens": 16, "temperature": 0, "stream": True}
        while not self.stop.is_set():
            start, status, fingerprint = time.time(), 0, None
            try:
                with requests.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=120) as reply:
                    status = reply.status_code
                    for line in reply.iter_lines(decode_unicode=True):
                        if line.startswith("data: {"):
                            fingerprint = json.loads(line[6:]).get("system_fingerprint", fingerprint)
            except requests.RequestException:
                status = 0
            self.done.append((start, time.time(), status, fingerprint))


def measure(way: str, url: str, run_dir: Path, clients: int, swaps: int, redeploy) -> dict[str, Any]:
    loads = [Load(url, i) for i in range(clients)]
    for load in loads:
        load.start()
    time.sleep(5)  # warm-up (the first iterations), left out of the figures
    measured_from = time.time()
    time.sleep(5)  # a baseline before the first change
    windows, first_answers = [], []
    for i in range(swaps):
        step = 10 * (i + 2)
        run_distributed(commit_checkpoint, 1, str(run_dir), step)
        committed = time.time()
        if redeploy:
            redeploy(run_dir / checkpoint_name(step))
        fingerprint = f"gpt_ddp@{step}"
        while not any(f == fingerprint for load in loads for *_, f in load.done):
            time.sleep(0.05)
        answered = min(end for load in loads for _, end, _, f in load.done if f == fingerprint)
        first_answers.append(answered - committed)
        windows.append((committed, answered))
        time.sleep(3)
    for load in loads:
        load.stop.set()
    for load in loads:
        load.join(timeout=120)
    done = [d for load in loads for d in load.done if d[0] >= measured_from]
    during = sorted(end - start for start, end, status, _ in done
                    if status == 200 and any(start < w_end and end > w_start for w_start, w_end in windows))
    calm = sorted(end - start for start, end, status, _ in done
                  if status == 200 and not any(start < w_end and end > w_start for w_start, w_end in windows))
    return {"way": way, "changes": swaps, "commit to first answer s": max(first_answers),
            "p50 calm ms": percentile(calm, 50), "p99 calm ms": percentile(calm, 99),
            "p50 during ms": percentile(during, 50), "p99 during ms": percentile(during, 99),
            "requests": len(done), "failed": sum(1 for *_, status, _ in done if status != 200)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--swaps", type=int, default=3)
    args = parser.parse_args()
    from shardyard.serve.app.deployment import build_app

    rows = []
    with local_serve() as (port, _), tempfile.TemporaryDirectory() as tmp:
        for way in ("hot swap (follow)", "redeploy (serve.run)"):
            run_dir = Path(tmp) / way.split()[0] / "gpt_ddp"
            run_distributed(commit_checkpoint, 1, str(run_dir), 10)
            follow = way.startswith("hot")
            serve.run(build_app({**APP, "checkpoint": str(run_dir), "follow": follow, "follow.interval_s": 0.5}),
                      name="follow_bench", route_prefix="/b")

            def redeploy(checkpoint: Path) -> None:  # Serve's way: the app again, pointed at the new weights
                serve.run(build_app({**APP, "checkpoint": str(checkpoint), "follow": False}),
                          name="follow_bench", route_prefix="/b")

            rows.append(measure(way, f"http://127.0.0.1:{port}/b", run_dir, args.clients, args.swaps,
                                None if follow else redeploy))
            print(rows[-1], flush=True)
            serve.delete("follow_bench")
    print_table(f"New weights under load ({args.clients} streaming clients, 2 pipeline shards, default GPT)", rows)
    hot = rows[0]
    ratio = hot["p99 during ms"] / hot["p99 calm ms"] if hot["p99 during ms"] and hot["p99 calm ms"] else None
    print(f"\nhot swap: p99 during a swap / p99 without: {ratio and round(ratio, 2)} (target <= 1.5); "
          f"failed requests: {hot['failed']} (target 0)")
    write_json("serve_follow", {"rows": rows, "hot_p99_ratio": ratio,
                                "targets": {"hot_p99_ratio": 1.5, "hot_failed": 0}})


if __name__ == "__main__":
    main()
