"""How long a checkpoint stops training: synchronous against asynchronous saves
(`checkpoint.async_write`), side by side in one run, on two model shapes.

Two gloo ranks train a GPT with FSDP2 (AdamW: weights and two moments, all fp32) and save every
few steps through the CheckpointManager, as the Trainer does. Per save, the time the training loop
is blocked: the `save` call, where a synchronous save writes everything and commits it, and an
asynchronous one copies the state to memory and leaves the write to a background thread (its
commit comes at the next save, which first waits for a write still in flight: that wait counts as
blocking too). Reported: mean blocking seconds per save, the wait at the end for the last write,
each mode's step time while saves run, and async / sync. Read the ratios: a 2-core machine shares
its cores between the background write and training.

    python benchmarks/checkpoint_blocking.py [--saves 3] [--steps-between 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import common  # noqa: F401  (puts the package on sys.path)
import torch

from common import print_table, write_json
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.spec import parse_spec

SHAPES = {"gpt 8x512 (25M)": {"n_layer": 8, "n_head": 8, "n_embd": 512},
          "gpt 12x1024 (0.15B)": {"n_layer": 12, "n_head": 16, "n_embd": 1024}}


def spec_for(shape: dict, storage: str, asynchronous: bool):
    return parse_spec({"model": {**shape, "block_size": 64, "vocab_size": 256},
                       "data": {"name": "synthetic", "num_samples": 256},
                       "optim": {"name": "adamw", "lr": 1e-4}, "parallelism": {"strategy": "fsdp"},
                       "batch": {"global_batch_size": 4, "micro_batch_size": 2}, "scaling": {"num_workers": 2},
                       "checkpoint": {"storage_path": storage, "keep": 2, "async_write": asynchronous},
                       "run": {"name": "async" if asynchronous else "sync"}})


def saving_run(rank: int, world: int, shape: dict, storage: str, asynchronous: bool, saves: int,
               steps_between: int) -> dict[str, float]:
    spec = spec_for(shape, storage, asynchronous)
    torch.manual_seed(0)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    manager = CheckpointManager(spec.run_uri, spec.checkpoint.keep, asynchronous=asynchronous)
    tokens = torch.randint(0, 256, (2, 65))
    batch = [(tokens[:, :-1], tokens[:, 1:])] * 2
    blocking, steps = [], []
    step = 0
    start = time.perf_counter()
    for _ in range(saves):
        for _ in range(steps_between):
            began = time.perf_counter()
            engine.train_step(batch)
            steps.append(time.perf_counter() - began)
            step += 1
        began = time.perf_counter()
        manager.save(engine, TrainState(step, step * 4, world), spec)  # waits for the previous write first
        blocking.append(time.perf_counter() - began)
    began = time.perf_counter()
    manager.close()  # the last write, committed: the run's end waits for it
    return {"blocking_s": statistics.mean(blocking), "end_s": time.perf_counter() - began,
            "step_s": statistics.mean(steps),
            "total_s": time.perf_counter() - start,
            "state_mb": sum(p.numel() for p in engine.parameters()) * 4 * 3 / 2**20}  # weights, 2 moments


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for label, shape in SHAPES.items():
        measured = {}
        for asynchronous in (False, True):
            with tempfile.TemporaryDirectory() as storage:
                measured[asynchronous] = run_distributed(saving_run, 2, shape, storage, asynchronous, args.saves,
                                                         args.steps_between)[0]
        sync, background = measured[False], measured[True]
        rows.append({"model": label, "state MB": sync["state_mb"],
                     "sync blocking s/save": sync["blocking_s"], "async blocking s/save": background["blocking_s"],
                     "async / sync blocking": background["blocking_s"] / sync["blocking_s"],
                     "sync end wait s": sync["end_s"], "async end wait s": background["end_s"],
                     "sync step s": sync["step_s"], "async step s": background["step_s"],
                     "sync total s": sync["total_s"], "async total s": background["total_s"]})
    print_table("Checkpoint blocking time per save: synchronous vs checkpoint.async_write (FSDP2, 2 gloo ranks)",
                rows)
    write_json("checkpoint_blocking", {"saves": args.saves, "steps_between": args.steps_between, "rows": rows})


if __name__ == "__main__":
    main()
