"""The small job every strategy test trains, and the oracle it is checked against: the same model,
data and global batch trained in one process (tests/parallel/test_strategies.py says why two optimizers)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist

from shardyard.data import build_dataset, micro_batch_ids, sample_order
from shardyard.layout.world_size import grad_accum_steps
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import load_spec, parse_spec
from shardyard.train.trainer import Trainer

STEPS, RESUME_AT = 4, 2
PARAM_TOL, LOSS_RTOL, RESUME_TOL = 2e-5, 1e-5, 1e-6
# AdamW divides each gradient element by its own running magnitude, so an element whose gradient
# is near rounding level steps by up to lr on the rounding alone, and reduction orders differ
# between strategies: up to 5e-5 measured after 4 steps at lr 1e-3 (losses equal to 1e-5). Plain
# SGD, whose update is linear in the gradient, is every strategy's tight oracle (PARAM_TOL).
ADAMW_PARAM_TOL = 1e-4
ADAMW = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "warmup_steps": 1, "grad_clip": 0.5}
# Large enough that a gradient off by a constant factor moves parameters far past PARAM_TOL.
SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 1}


def job(parallelism: dict, world: int, micro_batch: int, optim: dict = ADAMW, tie: bool | None = None) -> dict:
    return {
        "model": {"name": "gpt", "n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 16,
                  "tie_weights": parallelism.get("pp", 1) == 1 if tie is None else tie},
        "data": {"name": "synthetic", "num_samples": 256},
        "optim": optim,
        "batch": {"global_batch_size": 16, "micro_batch_size": micro_batch},
        "parallelism": parallelism,
        "scaling": {"num_workers": world},
        "checkpoint": {"every_n_steps": RESUME_AT, "keep": 5},
        "run": {"steps": STEPS, "seed": 5, "log_every": 1},
    }


OPTIMIZERS = {"adamw": ADAMW, "sgd": SGD}


def with_storage(raw: dict, storage: Path, steps: int = STEPS) -> dict:
    return raw | {"checkpoint": {**raw["checkpoint"], "storage_path": str(storage)},
                  "run": {**raw["run"], "steps": steps, "name": "run"}}


def train(rank: int, world: int, raw: dict, until: int | None = None) -> None:
    Trainer.build(parse_spec(raw), rank, world, torch.device("cpu")).train(until)


def steps(engine, spec, start: int, stop: int, grad_norms: list[float] | None = None) -> list[float]:
    """An engine's math without the Trainer (the single-process oracle, and tests that look at
    every step): train from step `start` to `stop`, return the global mean loss of each step
    (and append each step's gradient norm to `grad_norms`)."""
    dataset = build_dataset(spec)
    order = sample_order(dataset, spec.run.seed)
    accum = grad_accum_steps(spec, dist.get_world_size() if dist.is_initialized() else 1)
    losses = []
    for step in range(start, stop):
        ids = micro_batch_ids(order, step * spec.batch.global_batch_size, engine.dp_rank,
                              engine.dp_size, spec.batch.micro_batch_size, accum)
        loss = engine.train_step([dataset.batch(i) for i in ids])
        if dist.is_initialized():
            dist.all_reduce(loss)
        losses.append(loss.item() / engine.loss_ranks)
        if grad_norms is not None:
            grad_norms.append(float(engine.grad_norm))
    return losses


@functools.cache
def oracle_run(tie_weights: bool, optim: str = "adamw",
               global_batch: int = 16) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS steps in one process on the whole global batch: per-step losses, final parameters."""
    raw = job({"strategy": "ddp"}, 1, global_batch, OPTIMIZERS[optim], tie_weights)
    raw["batch"] = {"global_batch_size": global_batch, "micro_batch_size": global_batch}
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    losses = steps(engine, spec, 0, STEPS, ORACLE_GRAD_NORMS.setdefault((tie_weights, optim, global_batch), []))
    return losses, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


ORACLE_GRAD_NORMS: dict[tuple, list[float]] = {}  # oracle_run's, per step, by its arguments


def train_locally(rank: int, world: int, config: Path | None, overrides: list[str]) -> None:
    """What a Ray Train worker of rank `rank` runs, on a local gloo rank: a reference run."""
    Trainer.build(load_spec(config, overrides), rank, world, torch.device("cpu")).train()
