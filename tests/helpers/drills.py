"""The drills' small job (a 2-block GPT, one worker) and a committed checkpoint of it written
directly, as a run that trained two steps leaves it."""

from __future__ import annotations

from pathlib import Path

import torch

from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.record import step_of
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from shardyard.storage.store import RunStorage


def job(storage: Path, **sections: dict) -> dict:
    raw = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
           "data": {"name": "synthetic", "num_samples": 64}, "scaling": {"num_workers": 1},
           "batch": {"global_batch_size": 8, "micro_batch_size": 8},
           "checkpoint": {"storage_path": str(storage)}, "run": {"name": "run", "steps": 4}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def write_checkpoint(raw: dict) -> None:
    """A committed checkpoint at step 2 of `raw`, as a run that trained 2 steps leaves it."""
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    CheckpointManager(spec.run_uri, keep=2).save(engine, TrainState(2, 16, 1), spec)


def checkpoints(storage) -> list[int]:
    return sorted(step_of(name) for name in RunStorage(str(storage / "run")).checkpoint_names())  # not saves in flight
