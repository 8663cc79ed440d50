"""A failure at a fixed world size: a crash while a checkpoint is being written. Ray Train
restarts the worker group, the loop resumes from the last complete checkpoint, and the run ends
exactly where an uninterrupted run ends, with every sample of each epoch used exactly once
(sample ledger). Workers killed from outside, and nodes dying, are in test_elastic.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from shardyard.data.ledger import audit
from shardyard.localdist import run_distributed
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.storage.events import read_events
from helpers.oracle import train_locally
from helpers.repo import DEFAULT_JOB, SHARDYARD

NUM_SAMPLES, GLOBAL_BATCH, STEPS = 256, 16, 256  # 16 steps per epoch; 16 epochs


def job(storage: Path, name: str) -> list[str]:
    return ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
            "data.name=synthetic", f"data.num_samples={NUM_SAMPLES}",
            f"batch.global_batch_size={GLOBAL_BATCH}", "batch.micro_batch_size=4",
            "optim.schedule=constant", f"run.steps={STEPS}", "run.log_every=50",
            "checkpoint.every_n_steps=50", "checkpoint.keep=2", "run.sample_ledger=true",
            "scaling.max_failures=2", f"checkpoint.storage_path={storage}", f"run.name={name}"]


def start_run(ray_cluster, run_dir: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [SHARDYARD, "train", str(DEFAULT_JOB)]
    for item in job(run_dir.parent, run_dir.name):
        command += ["--set", item]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address, **(extra_env or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same job run straight through, on local ranks (the same Trainer as on Ray Train's
    workers): what every interrupted run must end with."""
    storage = tmp_path_factory.mktemp("straight")
    run_distributed(train_locally, 2, DEFAULT_JOB, job(storage, "straight"))
    return load_model(find_latest(storage / "straight")).state_dict()


def assert_same_model(run_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    # Same world size, same data order, deterministic math: the same model as never failing.
    got = load_model(find_latest(run_dir)).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def assert_exact_data(run_dir: Path) -> None:
    """The trajectory that produced the final model: every step once, every sample once per epoch."""
    report = audit(run_dir, NUM_SAMPLES)
    assert report.attempts >= 2 and report.steps == STEPS
    assert report.complete_epochs == STEPS * GLOBAL_BATCH // NUM_SAMPLES
    assert report.exact, report


@pytest.mark.timeout(420)
def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(ray_cluster, uninterrupted,
                                                                  tmp_path: Path) -> None:
    """Rank 1 dies as the checkpoint of step 200 is being written, after rank 0 has started it:
    the uncommitted checkpoint must be ignored and the previous one restored."""
    run_dir = tmp_path / "crashed"
    proc = start_run(ray_cluster, run_dir, {"SHARDYARD_INJECT_CRASH": "checkpoint:200"})
    output, _ = proc.communicate(timeout=360)
    assert proc.returncode == 0, output[-4000:]

    events = read_events(run_dir)
    # Each worker group's start-up is reported once its first step ends, the restarted one's too.
    assert [e["event"] for e in events] == ["launch", "start", "first_step", "injected_crash", "failure", "start",
                                            "first_step"], events
    crash, restart, restarted = events[3], events[5], events[6]
    assert restarted["step"] == 151 and restarted["load_s"] > 0 and restarted["since_command_s"] > 0
    assert crash["step"] == 200 and crash["latest_complete"] is not None
    # The newest complete checkpoint when the crash happened, never the partial one.
    assert crash["latest_complete"] == "checkpoint_step_00000150"
    assert restart["restored_step"] == 150, events
    # The console says the failure and the restart, a line each.
    lost = [line for line in output.splitlines() if line.startswith("shardyard: worker lost (rank ")]
    assert len(lost) == 1 and lost[0].endswith("; restarting from step 150 (1 of 2)"), output[-4000:]
    assert "shardyard: training again on 2 workers from step 150 (" in output, output[-4000:]
    # Ray's and gloo's tracebacks of the failure are in the run's Ray log, not on the console.
    assert "Traceback" not in output and f"Ray's tracebacks of this launch go to {run_dir / 'ray_output.log'}" \
        in output, output[-4000:]
    assert "Traceback (most recent call last):" in (run_dir / "ray_output.log").read_text()
    assert_exact_data(run_dir)
    assert_same_model(run_dir, uninterrupted)
    # Pruning counts committed checkpoints only: the newest `checkpoint.keep` (2) are left, and
    # the uncommitted directory is gone.
    assert sorted(p.name for p in run_dir.glob("checkpoint_step_*")) == [
        "checkpoint_step_00000250", "checkpoint_step_00000256"]
