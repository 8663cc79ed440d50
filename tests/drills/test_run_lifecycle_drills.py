"""Drills and journeys over several launches of one run, on real Ray Train workers.

The same run launched again and again, with pruning in between (`checkpoint.keep: 1`): longer,
under another strategy, at another world size; stopped by SIGTERM and continued; and a run whose
loss diverges. Each launch resumes from shardyard's commit records alone: Ray Train is told of no
checkpoint that pruning could delete behind its back (a pruned run once could not be launched
again). Storage is the test's own, never the checkout's runs/.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from shardyard.storage.events import read_events
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.spec import load_spec
from shardyard.train.outcomes import RunGaveUp
from shardyard.train.launcher import launch
from shardyard.train.metrics import read_metrics
from helpers.repo import REPO, SHARDYARD

DEFAULT_JOB = REPO / "jobs" / "configs" / "gpt_ddp.yaml"


def job(storage: Path, steps: int, *extra: str) -> list[str]:
    return ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
            "data.name=synthetic", "data.num_samples=64", "batch.global_batch_size=16",
            "batch.micro_batch_size=4", "optim.warmup_steps=1", "run.log_every=1", "run.sample_ledger=true",
            "checkpoint.every_n_steps=2", "checkpoint.keep=1", f"checkpoint.storage_path={storage}",
            "run.name=journey", f"run.steps={steps}", *extra]


def restored_steps(run: Path) -> list[int]:
    return [e["restored_step"] for e in read_events(run) if e["event"] == "start"]


@pytest.mark.drill(outcome="recovered", lost="nothing")
@pytest.mark.timeout(900)
def test_a_pruned_run_launches_again_and_again_across_strategies_and_world_sizes(ray_cluster, tmp_path: Path) -> None:
    run = tmp_path / "journey"
    # Longer each time; ddp -> zero1 -> fsdp -> tensor; world size 2 -> 2 -> 1 -> 2.
    launches = [(4, ["scaling.num_workers=2"]),
                (6, ["scaling.num_workers=2", "parallelism.strategy=zero1"]),
                (8, ["scaling.num_workers=1", "parallelism.strategy=fsdp"]),
                (10, ["scaling.num_workers=2", "parallelism.strategy=tensor", "parallelism.tp=2"])]
    for steps, extra in launches:
        launch(load_spec(None, job(tmp_path, steps, *extra)))
        assert find_latest(run).name == f"checkpoint_step_{steps:08d}"
        # Pruned to one: the run's only checkpoint is the newest.
        assert sorted(p.name for p in run.glob("checkpoint_step_*")) == [f"checkpoint_step_{steps:08d}"]
    assert restored_steps(run) == [0, 4, 6, 8]
    # Every step trained once: no step logged twice or skipped, across four launches.
    assert [row["step"] for row in read_metrics(run)] == list(range(1, 11))
    from shardyard.data.ledger import audit

    report = audit(run, num_samples=64)
    assert report.exact and report.steps == 10 and report.complete_epochs == 2, report
    assert all(torch.isfinite(v).all() for v in load_model(find_latest(run)).state_dict().values())


def _story(run: Path) -> str:
    """What a failed assertion about a run's end shows: its events, and its metrics file's last
    lines as written (restart markers included)."""
    events = [{k: e[k] for k in ("event", "step", "restored_step", "launch") if k in e} for e in read_events(run)]
    tail = (run / "metrics.jsonl").read_text().splitlines()[-6:]
    return "events: " + "\n".join(map(str, events)) + "\nmetrics.jsonl ends:\n" + "\n".join(tail) + "\n"


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until the run has logged `step` (an event the run emits, not a guess at its speed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if any(row["step"] >= step for row in read_metrics(run)):
            return
        time.sleep(0.2)
    raise AssertionError(f"the run never reached step {step}")


@pytest.mark.drill(outcome="checkpointed and exits 143", lost="at most the step in flight")
@pytest.mark.timeout(600)
def test_sigterm_checkpoints_at_the_next_step_and_the_next_launch_loses_nothing(ray_cluster, tmp_path: Path) -> None:
    """What a spot instance's notice, a Kubernetes eviction or `ray job stop` sends: the run
    checkpoints at the next step boundary (its interval is far away), exits 143, and the next
    launch goes on from there. Signals sent again and again (a user's impatience, an orchestrator's
    retries) change nothing: the handler only queues the notice, and one checkpoint is taken."""
    run = tmp_path / "journey"
    overrides = job(tmp_path, 100000, "checkpoint.every_n_steps=50000")
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    proc = subprocess.Popen([SHARDYARD, "train", str(DEFAULT_JOB), *[a for o in overrides for a in ("--set", o)]],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run, 3, proc)
        for _ in range(20):  # apart, or Python runs the handler once for signals pending together
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out + err
    assert "launch it again to continue" in err and "Traceback" not in err, err
    assert err.count("SIGTERM: checkpointing") == 1, err
    logged = max(row["step"] for row in read_metrics(run))
    stopped_at = int(find_latest(run).name[-8:])
    # The step it stopped at is the one checkpointed.
    assert 3 <= stopped_at and stopped_at == logged, _story(run) + err[-3000:]
    launch(load_spec(None, job(tmp_path, stopped_at + 2, "checkpoint.every_n_steps=50000")))
    assert restored_steps(run)[-1] == stopped_at
    assert [row["step"] for row in read_metrics(run)] == list(range(1, stopped_at + 3))


@pytest.mark.ray  # README's local Ray, started by `shardyard train` itself
@pytest.mark.drill(outcome="checkpointed and exits 130; a second Ctrl-C stops at once, saying from which step",
                   lost="nothing; after a second Ctrl-C the steps since the last checkpoint")
@pytest.mark.timeout(600)
def test_ctrl_c_checkpoints_like_sigterm_and_a_second_one_stops_at_once(tmp_path: Path) -> None:
    """Ctrl-C as a user presses it: the terminal sends SIGINT to the whole foreground process
    group (`shardyard train` and the local Ray it started, as README runs it, no cluster of the
    test session's). The run checkpoints at the next step boundary and exits 130, and the next
    launch goes on from there. Then a launch held mid-run (no step boundary comes) gets Ctrl-C
    twice: it stops at once, saying from which step a new launch resumes."""
    from shardyard.train.callbacks import HOLD_ENV, held_at, release

    run = tmp_path / "journey"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def train(steps: int, extra_env: dict[str, str]) -> subprocess.Popen:
        overrides = job(tmp_path, steps, "checkpoint.every_n_steps=50000")
        return subprocess.Popen([SHARDYARD, "train", str(DEFAULT_JOB), *[a for o in overrides for a in ("--set", o)]],
                                cwd=tmp_path, env={**env, **extra_env}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    def ctrl_c(proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGINT)

    proc = train(100000, {})
    try:
        _wait_for_step(run, 3, proc)
        ctrl_c(proc)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert err.count("Ctrl-C: checkpointing") == 1 and "launch it again to continue" in err, err
    assert "Traceback" not in err, err
    stopped_at = int(find_latest(run).name[-8:])
    assert 3 <= stopped_at == max(row["step"] for row in read_metrics(run))

    held = stopped_at + 2  # the next launch holds after this step: no step boundary comes
    proc = train(100000, {HOLD_ENV: str(held)})
    try:
        deadline = time.monotonic() + 300
        while held_at(run, held) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        ctrl_c(proc)
        said = []  # the driver's stderr up to its answer to the first Ctrl-C: then the second
        while not said or "Ctrl-C: checkpointing" not in said[-1]:
            line = proc.stderr.readline()
            assert line, "".join(said)
            said.append(line)
        ctrl_c(proc)
        out, err = proc.communicate(timeout=120)
        err = "".join(said) + err
    finally:
        release(run, held)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert f"second Ctrl-C: run 'journey' stopped at once; a new launch resumes from step {stopped_at}" in err, err
    assert "Traceback" not in err, err
    assert restored_steps(run) == [0, stopped_at]


@pytest.mark.drill(outcome="exits 3, not 143", lost="the steps since the last checkpoint")
@pytest.mark.timeout(300)
def test_a_sigterm_whose_checkpoint_cannot_commit_in_time_exits_3_not_143(ray_cluster, tmp_path: Path) -> None:
    """The run is held (a hung step) when SIGTERM arrives, so no checkpoint can commit within
    checkpoint.preempt_timeout_s: the driver gives up with exit 3, saying so, not the 143 that
    means "checkpointed, nothing lost" (before, both were 143)."""
    from shardyard.train.callbacks import HOLD_ENV, held_at, release

    run = tmp_path / "journey"
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address, HOLD_ENV: "2"}
    proc = subprocess.Popen([SHARDYARD, "train", str(DEFAULT_JOB),
                             *[a for o in job(tmp_path, 6, "checkpoint.preempt_timeout_s=2") for a in ("--set", o)]],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while held_at(run, 2) is None:  # held after committing step 2: no step boundary comes
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        release(run, 2)  # the held workers go on and end with their driver
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out + err
    assert "no checkpoint committed within checkpoint.preempt_timeout_s" in err, err
    assert find_latest(run).name == "checkpoint_step_00000002"


@pytest.mark.drill(outcome="stops naming the step", lost="nothing committed from a non-finite state")
@pytest.mark.timeout(600)
def test_a_diverging_run_stops_naming_the_step_and_commits_nothing_non_finite(ray_cluster, tmp_path: Path) -> None:
    run = tmp_path / "journey"
    with pytest.raises(RunGaveUp, match=r"the loss or gradient norm is not finite at step \d+"):
        launch(load_spec(None, job(tmp_path, 12, "optim.lr=1e6", "optim.grad_clip=0", "checkpoint.every_n_steps=1",
                                    "checkpoint.keep=100")))
    diverged = [e for e in read_events(run) if e["event"] == "diverged"]
    assert len(diverged) == 1  # not retried: the same state diverges again
    for checkpoint in run.glob("checkpoint_step_*"):
        if (checkpoint / "COMMITTED").exists():
            weights = load_model(checkpoint).state_dict().values()
            assert all(torch.isfinite(v).all() for v in weights), checkpoint.name
            assert int(checkpoint.name[-8:]) < diverged[0]["step"]
    # (`run.on_nonfinite: skip` is tested on two gloo ranks in tests/train/test_step_guard.py.)
