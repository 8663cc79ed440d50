"""Checkpoints: what is saved, where it goes, and how a run finds and restores the latest one.

Model and optimizer state go through `torch.distributed.checkpoint` (DCP): every rank writes its
own shard, and loading reshards to whatever world size is running now. Beside the shards rank 0
writes the trainer state (step, data position, LR schedule) and the job spec, so one checkpoint
directory is enough to resume training or to rebuild the model for serving.

Ray Train owns persistence: each rank hands its local directory to `ray.train.report`, Ray merges
them into one checkpoint directory under `<storage_path>/<run.name>/`, keeps the newest
`checkpoint.keep` and hands the latest back through `ray.train.get_checkpoint()` on restart.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from shardyard.models import build_model
from shardyard.parallel import Engine
from shardyard.spec import JobSpec

STATE_FILE = "trainer_state.pt"
SPEC_FILE = "spec.json"
DIR_PREFIX = "checkpoint_step_"


@dataclass
class TrainState:
    step: int = 0          # optimizer steps completed
    samples_seen: int = 0  # global position in the sample order (see data/sampler.py)
    world_size: int = 1    # world size that wrote the checkpoint


def _sharded_state(engine: Engine) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save(engine: Engine, state: TrainState, spec: JobSpec, directory: Path, rank: int) -> None:
    """Collective: every rank must call it. Writes this rank's shard into `directory`."""
    dcp.save(_sharded_state(engine), checkpoint_id=str(directory))
    if rank == 0:
        torch.save({**asdict(state), "scheduler": engine.scheduler.state_dict()}, directory / STATE_FILE)
        (directory / SPEC_FILE).write_text(spec.model_dump_json(indent=2))


def load(engine: Engine, directory: Path) -> TrainState:
    """Collective: restore model, optimizer and schedule; returns where training stopped."""
    sharded = _sharded_state(engine)
    dcp.load(sharded, checkpoint_id=str(directory))
    set_state_dict(engine.model, engine.optimizer,
                   model_state_dict=sharded["model"], optim_state_dict=sharded["optim"])
    meta = torch.load(directory / STATE_FILE, weights_only=True)
    engine.scheduler.load_state_dict(meta.pop("scheduler"))
    return TrainState(**meta)


def restore_latest(engine: Engine) -> TrainState | None:
    """Resume from the checkpoint Ray Train hands this worker group, if any."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return load(engine, Path(directory))


def report(metrics: dict[str, Any], engine: Engine, state: TrainState, spec: JobSpec,
           rank: int) -> None:
    """Save and hand a checkpoint to Ray Train. Collective: every rank calls it at the same steps."""
    with tempfile.TemporaryDirectory(prefix="shardyard-ckpt-") as tmp:
        save(engine, state, spec, Path(tmp), rank)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=f"{DIR_PREFIX}{state.step:08d}")


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory of a run, for readers outside Ray Train."""
    complete = [p for p in Path(run_dir).glob(f"{DIR_PREFIX}*") if (p / STATE_FILE).is_file()]
    return max(complete, key=lambda p: p.name, default=None)


def read_spec(checkpoint_dir: str | Path) -> JobSpec:
    return JobSpec.model_validate(json.loads((Path(checkpoint_dir) / SPEC_FILE).read_text()))


def load_model(checkpoint_dir: str | Path) -> nn.Module:
    """Rebuild the trained model in one process from any checkpoint, whatever world size wrote it
    (with no_dist, DCP reads every shard itself)."""
    model = build_model(read_spec(checkpoint_dir).model)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        # DCP warns that it assumes a single-process load even when told so with no_dist.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    model.load_state_dict(state["model"])
    return model
