"""Every rank takes the same branch at the same step: a non-finite loss stops all of them
(`run.on_nonfinite: stop`) or all of them leave the step's update out (`skip`), and a preemption
notice makes all of them checkpoint at the next step boundary. Real torch.distributed ranks (gloo)
and the real Trainer; plain SGD, so a step that was applied would show in the parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardyard.storage.events import read_events
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.storage.store import RunStorage
from shardyard.localdist import run_distributed
from shardyard.spec import load_spec
from shardyard.train.step_guard import PREEMPT_FILE, Diverged
from shardyard.train.trainer import Callback, Trainer


def overrides(storage: Path, *extra: str) -> list[str]:
    return ["model.n_layer=2", "model.n_head=2", "model.n_embd=16", "model.block_size=8", "data.name=synthetic",
            "data.num_samples=64", "batch.global_batch_size=8", "batch.micro_batch_size=4", "optim.name=sgd",
            "optim.momentum=0", "optim.grad_clip=0", "optim.warmup_steps=1", "optim.schedule=constant",
            "run.log_every=1", "checkpoint.every_n_steps=100", f"checkpoint.storage_path={storage}", "run.name=run",
            "scaling.num_workers=2", *extra]


class PoisonStep(Callback):
    """Makes one rank's loss of step `step` NaN (a NaN parameter on that rank alone, restored
    before the update would apply)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.saved: float | None = None

    def on_step_start(self, trainer: Trainer, ids) -> None:
        if trainer.state.step + 1 == self.step and trainer.rank == 1:
            weight = next(trainer.engine.model.parameters())
            with torch.no_grad():
                self.saved = weight.view(-1)[0].item()
                weight.view(-1)[0] = float("nan")

    def on_step_end(self, trainer: Trainer) -> None:
        if self.saved is not None:  # the step ran (skipped): the rank gets its own value back
            with torch.no_grad():
                next(trainer.engine.model.parameters()).view(-1)[0] = self.saved
            self.saved = None


def train_rank(rank: int, world: int, storage: str, extra: list[str], poison: int | None) -> dict:
    spec = load_spec(None, overrides(Path(storage), *extra))
    callbacks = [PoisonStep(poison)] if poison else []
    trainer = Trainer.build(spec, rank, world, torch.device("cpu"), callbacks=callbacks)
    try:
        trainer.train()
    except Diverged as err:
        return {"diverged": str(err), "step": trainer.state.step}
    return {"step": trainer.state.step, "preempted": trainer.preempted}


@pytest.mark.timeout(180)
def test_a_nan_on_one_rank_stops_every_rank_at_that_step_and_commits_nothing(tmp_path: Path) -> None:
    results = run_distributed(train_rank, 2, str(tmp_path), ["run.steps=6"], 3)
    assert [r.get("step") for r in results] == [3, 3]
    assert all("not finite at step 3" in r["diverged"] for r in results), results
    assert find_latest(tmp_path / "run") is None


@pytest.mark.timeout(180)
def test_skip_leaves_the_nan_steps_update_out_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(train_rank, 2, str(tmp_path), ["run.steps=4", "run.on_nonfinite=skip"], 3)
    assert [r["step"] for r in results] == [4, 4]
    skipped = [e["step"] for e in read_events(tmp_path / "run") if e["event"] == "skipped_nonfinite"]
    assert skipped == [3]
    # Had the step applied, DDP's averaged gradient would have put NaN into every rank's weights.
    assert all(torch.isfinite(v).all() for v in load_model(find_latest(tmp_path / "run")).state_dict().values())


@pytest.mark.timeout(180)
def test_a_preemption_notice_checkpoints_every_rank_at_the_next_step(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    storage.write_bytes(b"now", PREEMPT_FILE)  # present from the start: the first step boundary acts
    results = run_distributed(train_rank, 2, str(tmp_path), ["run.steps=50"], None)
    assert [(r["step"], r["preempted"]) for r in results] == [(1, True), (1, True)]
    assert find_latest(tmp_path / "run").name == "checkpoint_step_00000001"
