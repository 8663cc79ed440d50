"""checkpoint.async_write: the loop blocks only while DCP copies the state to memory; the commit
record is written once the background write is done, and the lease fence and a preemption notice
still hold over a write in flight. On torch.distributed gloo ranks, without Ray (the Ray run with
asynchronous checkpoints: tests/train/test_train_ray.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardyard.checkpoint.lease import LeaseLost
from shardyard.checkpoint.record import COMMIT_FILE, checkpoint_name
from shardyard.storage.store import RunStorage
from shardyard.localdist import run_distributed
from shardyard.spec import load_spec
from shardyard.train.step_guard import PREEMPT_FILE
from shardyard.train.trainer import Callback, Trainer

pytestmark = pytest.mark.timeout(120)


def job(storage: str) -> list[str]:
    return ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16", "data.name=synthetic",
            "data.num_samples=256", "batch.global_batch_size=8", "batch.micro_batch_size=4", "run.steps=8",
            "checkpoint.every_n_steps=2", "checkpoint.keep=5", "checkpoint.async_write=true",
            "parallelism.strategy=fsdp", f"checkpoint.storage_path={storage}", "run.name=run"]


class PreemptAfter(Callback):
    """The driver's preemption notice, as SIGTERM writes it, once step `step` has run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Trainer) -> None:
        if trainer.rank == 0 and trainer.state.step == self.step:
            RunStorage(trainer.spec.run_uri).write_bytes(b"notice", PREEMPT_FILE)


def preempted_run(rank: int, world: int, storage: str) -> tuple[bool, int]:
    trainer = Trainer.build(load_spec(None, job(storage)), rank, world, torch.device("cpu"),
                            callbacks=[PreemptAfter(3)])
    trainer.guard.notice_every_s = 0.0  # look for the notice at every step, so it is seen at step 3
    state = trainer.train()
    return trainer.preempted, state.step


def test_a_preempted_run_commits_the_write_in_flight_then_its_own(tmp_path: Path) -> None:
    """Step 2's write is in the background when step 3 sees the notice: step 2 commits, then the
    preemption checkpoint of step 3, and the run stops there."""
    assert run_distributed(preempted_run, 2, str(tmp_path)) == [(True, 3), (True, 3)]
    for step in (2, 3):
        record = json.loads((tmp_path / "run" / checkpoint_name(step) / COMMIT_FILE).read_text())
        assert record["step"] == step and record["world_size"] == 2
    assert not (tmp_path / "run" / checkpoint_name(4)).exists()


class LoseLeaseDuringWrite(Callback):
    """Another launch takes the run over while step 2's checkpoint is being written."""

    generation = 1  # the run's lease generation, as a launch's fence carries it

    def __init__(self) -> None:
        self.lost = False

    def __call__(self) -> None:
        if self.lost:
            raise LeaseLost("another launch holds the run")

    def on_checkpoint_end(self, trainer: Trainer) -> None:
        self.lost = True  # save() returned: the write goes on in the background


def fenced_run(rank: int, world: int, storage: str) -> str:
    taker = LoseLeaseDuringWrite()
    trainer = Trainer.build(load_spec(None, job(storage)), rank, world, torch.device("cpu"), callbacks=[taker],
                            fence=taker)
    try:
        trainer.train()
    except LeaseLost as err:
        return str(err)
    return "trained on"


def test_a_write_in_flight_when_the_lease_is_lost_is_never_committed(tmp_path: Path) -> None:
    assert run_distributed(fenced_run, 2, str(tmp_path)) == ["another launch holds the run"] * 2
    assert list((tmp_path / "run").glob(f"{checkpoint_name(2)}.attempt-*"))  # written, in part or whole
    assert not (tmp_path / "run" / checkpoint_name(2)).exists()  # never renamed into place: not committed
