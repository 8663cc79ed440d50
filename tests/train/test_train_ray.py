"""Training on real Ray Train workers (the session's `ray start` cluster): a run writes
checkpoints and metrics, and a run stopped after N steps resumes at N+1 and ends exactly where an
uninterrupted run ends. The uninterrupted run is the same Trainer on local gloo ranks: Ray adds
a worker group (about half a minute a launch here), not different math."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardyard.localdist import run_distributed
from shardyard.spec import load_spec
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.train.launcher import launch
from shardyard.train.metrics import LOSS_PLOT, read_metrics
from shardyard.train.tracking import TENSORBOARD_DIR
from helpers.oracle import train_locally


def tiny_job(storage: Path, name: str, steps: int) -> list[str]:
    # A constant LR after warmup, so a run cut at step N and extended to M follows the same
    # schedule as one run straight to M (a cosine's length depends on run.steps).
    return [
        "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
        "data.name=synthetic", "data.num_samples=512",
        "batch.global_batch_size=16", "batch.micro_batch_size=4",  # 2 accumulation steps
        "optim.warmup_steps=2", "optim.schedule=constant", f"run.steps={steps}", "run.log_every=1",
        "checkpoint.every_n_steps=3", "checkpoint.keep=2",
        f"checkpoint.storage_path={storage}", f"run.name={name}",
    ]


def logged_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir)]


@pytest.mark.timeout(400)
def test_run_writes_outputs_and_a_stopped_run_resumes_at_the_next_step_identically(
        ray_cluster, tmp_path: Path) -> None:
    # FSDP with asynchronous checkpoints (copied to memory before training goes on); synchronous
    # DDP checkpoints are resumed bitwise in test_fault_tolerance.py.
    extra = ["checkpoint.async_write=true", "parallelism.strategy=fsdp"]
    run_distributed(train_locally, 2, None, tiny_job(tmp_path, "straight", steps=7) + extra)
    expected = load_model(find_latest(tmp_path / "straight")).state_dict()
    # Trained weights differ from the initial ones: the checkpoint holds real training state.
    spec = load_spec(None, tiny_job(tmp_path, "straight", steps=7))
    torch.manual_seed(spec.run.seed)
    from shardyard.models import build_model

    initial = build_model(spec.model).state_dict()
    assert any(not torch.equal(initial[k], expected[k]) for k in initial)

    first = launch(load_spec(None, tiny_job(tmp_path, "resumed", steps=3) + extra))
    assert first.summary["steps"] == 3 and first.summary["world_size"] == 2
    # A crash mid-write leaves a directory that rank 0 never committed: the next launch ignores it.
    partial = first.run_dir / "checkpoint_step_00000099"
    partial.mkdir()
    (partial / "trainer_state.pt").write_bytes(b"rank 0 wrote this, then the writing stopped")
    second = launch(load_spec(None, tiny_job(tmp_path, "resumed", steps=7) + extra))
    run_dir = second.run_dir
    # Checkpoints at steps 3, 6 and the last step 7; keep=2 prunes the oldest.
    assert sorted(p.name for p in run_dir.glob("checkpoint_step_0000000*")) == [
        "checkpoint_step_00000006", "checkpoint_step_00000007"]
    assert find_latest(run_dir).name == "checkpoint_step_00000007"
    assert second.summary["tokens_per_s"] > 0
    assert (run_dir / LOSS_PLOT).stat().st_size > 0
    # The second launch picked up at step 4: every step logged exactly once across both launches,
    # in the metrics log and in TensorBoard's event files.
    assert logged_steps(run_dir) == list(range(1, 8))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    board.Reload()
    assert sorted(e.step for e in board.Scalars("train/loss")) == list(range(1, 8))
    final = torch.load(Path(second.checkpoint) / "trainer_state.pt", weights_only=True)
    assert TrainState(final["step"], final["samples_seen"], final["world_size"]) == TrainState(7, 112, 2)
    got = load_model(second.checkpoint).state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.timeout(300)
# FSDP and ZeRO-2 run on Ray Train workers in test_elastic.py (and resume there at another size).
@pytest.mark.parametrize("parallelism", [
    ["parallelism.strategy=pipeline", "parallelism.pp=2", "model.tie_weights=false"],
], ids=["pipeline"])
def test_sharded_strategies_train_on_ray_workers(ray_cluster, tmp_path: Path, parallelism: list[str]) -> None:
    """The launcher drives each strategy on Ray Train workers, and its checkpoint loads."""
    name = parallelism[0].split("=")[1]
    spec = load_spec(None, tiny_job(tmp_path, name, steps=4) + parallelism)
    result = launch(spec)
    assert result.summary["steps"] == 4 and result.summary["world_size"] == 2
    model = load_model(result.checkpoint)
    assert model(torch.randint(0, 256, (1, 16))).shape == (1, 16, 256)
