"""Synchronous against asynchronous data parallelism, with and without a straggler.

Four workers train the same model on the same data and global batch with: synchronous DDP, local
SGD (H = 4 and 16), and parameter servers (bounded staleness S = 1, and fully asynchronous).
Each runs twice: all workers at full speed, and with one worker deliberately 2x slower (a
collective rank sleeps as long again as each of its batches took; a parameter-server worker's
process is stopped from outside for as long again as each stretch it runs, as a busy machine
slows one). Reported: samples/s, wall-clock time from the end of
the first step until the smoothed training loss first reaches the target (the loss synchronous
DDP without a straggler reaches at 3/4 of the run), and the final smoothed loss.

DDP and local SGD run on plain gloo processes (the loss is rank 0's, smoothed); the parameter
servers run on a local Ray instance as `shardyard train` would run them (the loss is the servers'
stream of applied batches, smoothed). Expected: with a straggler the asynchronous modes reach the
target sooner in wall-clock time; without one, DDP is at least as fast. On a 2-core machine four
workers oversubscribe the cores, so a sleeping straggler also frees CPU for the others: read the
ratios, not the absolute times.

    python benchmarks/async_vs_sync.py [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import common  # noqa: F401  (puts the package on sys.path)
import psutil
import ray
import torch

from common import print_table, write_json
from shardyard.layout.world_size import grad_accum_steps
from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.spec import load_spec

WORKERS, SLOWDOWN, SMOOTHING = 4, 2.0, 0.8
STRAGGLE_PERIOD_S = 0.05  # how long the straggler runs between its stops


def overrides(steps: int, strategy: str, extra: list[str] = ()) -> list[str]:
    return ["model.n_layer=2", "model.n_embd=64", "model.block_size=32", "data.name=synthetic",
            "data.num_samples=2048", "batch.global_batch_size=32", "batch.micro_batch_size=8",
            "optim.warmup_steps=5", "optim.schedule=constant", "optim.grad_clip=0",
            f"parallelism.strategy={strategy}", f"scaling.num_workers={WORKERS}", f"run.steps={steps}",
            "run.log_every=1", *extra]


def smoothed(losses: list[float]) -> list[float]:
    out, value = [], None
    for loss in losses:
        value = loss if value is None else SMOOTHING * value + (1 - SMOOTHING) * loss
        out.append(value)
    return out


def collective_worker(rank: int, world: int, args: list[str], slow: bool) -> tuple[list[float], list[float]]:
    """(rank 0's loss, seconds since the end of step 1) per step; the slow rank sleeps."""
    spec = load_spec(None, args)
    torch.manual_seed(spec.run.seed)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    dataset = build_dataset(spec)
    order = GlobalSampleOrder(len(dataset), spec.run.seed)
    accum = grad_accum_steps(spec, world)
    losses, times, origin = [], [], None
    for step in range(spec.run.steps):
        started = time.perf_counter()
        ids = micro_batch_ids(order, step * spec.batch.global_batch_size, engine.dp_rank, engine.dp_size,
                              spec.batch.micro_batch_size, accum)
        loss = engine.train_step([dataset.batch(i) for i in ids]).item()
        if slow and rank == world - 1:
            time.sleep((SLOWDOWN - 1) * (time.perf_counter() - started))
        origin = origin or time.perf_counter()
        losses.append(loss)
        times.append(time.perf_counter() - origin)
    return losses, times


@contextmanager
def straggling(slowdown: float) -> Iterator[None]:
    """While in it, one parameter-server worker's process (Ray titles it `ray::PSWorker`) runs
    `slowdown` times slower: stopped for (slowdown - 1) x STRAGGLE_PERIOD_S after each period it
    runs. The platform is not told: to it the worker is on a slow machine."""
    done = threading.Event()

    def duty_cycle() -> None:
        worker = None
        while worker is None and not done.wait(0.1):
            titled = [p for p in psutil.process_iter(["cmdline"]) if "ray::PSWorker" in " ".join(p.info["cmdline"] or [])]
            worker = max(titled, key=lambda p: p.pid, default=None)
        while worker is not None and not done.wait(STRAGGLE_PERIOD_S):
            try:
                os.kill(worker.pid, signal.SIGSTOP)
                time.sleep((slowdown - 1) * STRAGGLE_PERIOD_S)
                os.kill(worker.pid, signal.SIGCONT)
            except ProcessLookupError:  # the run ended and its workers with it
                return

    thread = threading.Thread(target=duty_cycle, daemon=True) if slowdown > 1 else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread is not None:
            thread.join()


def parameter_server_run(args: list[str], slow: bool, storage: str) -> tuple[list[float], list[float]]:
    from shardyard.train.parameter_server import run as parameter_server
    from shardyard.train.metrics import read_metrics

    spec = load_spec(None, [*args, f"checkpoint.storage_path={storage}", "checkpoint.every_n_steps=1000"])
    with straggling(SLOWDOWN if slow else 1.0):
        parameter_server.run(spec)

    rows = read_metrics(Path(storage) / spec.run.name)
    return [r["loss"] for r in rows], [r["time"] - rows[0]["time"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    modes = {
        "ddp": ("ddp", []), "local_sgd H=4": ("local_sgd", ["parallelism.sync_every=4", "checkpoint.every_n_steps=4"]),
        "local_sgd H=16": ("local_sgd", ["parallelism.sync_every=16", "checkpoint.every_n_steps=16"]),
        "ps bounded S=1": ("parameter_server", ["parallelism.num_servers=2", "parallelism.max_staleness=1"]),
        "ps async": ("parameter_server", ["parallelism.num_servers=2"]),
    }
    ray.init(address="local", num_cpus=WORKERS + 4, include_dashboard=False, log_to_driver=False)
    curves = {}
    with tempfile.TemporaryDirectory() as storage:
        for slow in (False, True):
            for label, (strategy, extra) in modes.items():
                run_args = overrides(args.steps, strategy, [*extra, f"run.name={strategy}_{slow}_{len(curves)}"])
                if strategy == "parameter_server":
                    losses, times = parameter_server_run(run_args, slow, storage)
                else:
                    losses, times = run_distributed(collective_worker, WORKERS, run_args, slow)[0]
                curves[(label, slow)] = (smoothed(losses), times)
                print(f"{label} straggler={slow}: final smoothed loss {curves[(label, slow)][0][-1]:.4f} "
                      f"in {times[-1]:.1f} s", flush=True)
    ray.shutdown()

    reference = curves[("ddp", False)][0]
    target = reference[int(0.75 * len(reference))]
    rows = []
    for (label, slow), (losses, times) in curves.items():
        reached = next((t for loss, t in zip(losses, times) if loss <= target), None)
        elapsed = times[-1] or float("nan")
        rows.append({"mode": label, "straggler": "2x" if slow else "-",
                     "samples_per_s": (len(times) - 1) * 32 / elapsed,
                     "time_to_target_s": reached, "final_loss": losses[-1]})
    for slow in (False, True):
        ddp = next(r for r in rows if r["mode"] == "ddp" and r["straggler"] == ("2x" if slow else "-"))
        for r in rows:
            if r["straggler"] == ddp["straggler"] and r["time_to_target_s"] and ddp["time_to_target_s"]:
                r["vs_ddp_time"] = r["time_to_target_s"] / ddp["time_to_target_s"]
    print_table(f"{WORKERS} workers, {args.steps} steps of 32 samples; target loss {target:.4f} "
                f"(synchronous DDP's smoothed loss at step {int(0.75 * args.steps)})", rows)
    write_json("async_vs_sync", {"workers": WORKERS, "steps": args.steps, "slowdown": SLOWDOWN,
                                 "target_loss": target, "rows": rows})


if __name__ == "__main__":
    main()
