"""The GPU check (benchmarks/gpu_check.sh) run here as on a GPU machine, its stages on the
small model a machine without CUDA gets and the GPU-only ones skipped, so the script cannot rot
between GPU runs. Three calls, each under two minutes, and one that only validates the jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.user_shell import ray_files_of_their_own, user_environment
from helpers.repo import REPO


def device_check(out: Path, stages: str, ray_tmp: str | None = None, budget_s: float = 250) -> dict:
    """The one call, limited to `stages`; their results, checked to have run or been skipped."""
    env = user_environment(ray_tmp) if ray_tmp else dict(os.environ)
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--stages", stages, "--budget", str(budget_s)], cwd=REPO,
                          env={**env, "OUT": str(out), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=260)
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    failed = {name: stage["status"] for name, stage in summary["stages"].items()
              if not stage["status"].startswith(("ok", "skipped"))}
    assert not failed, (failed, log[-4000:])
    return summary["stages"]


@pytest.mark.timeout(300)
def test_the_plain_loop_serving_and_gpu_test_stages_run_here(tmp_path: Path) -> None:
    stages = device_check(tmp_path, "peak,loop,serving,pytest_gpu,train_float8")
    assert stages["peak"]["status"] == "skipped: needs a GPU"
    assert stages["train_float8"]["status"] == "skipped: needs a GPU of compute capability 8.9+"
    assert stages["pytest_gpu"]["tests"] > 0 and stages["pytest_gpu"]["skipped"] == stages["pytest_gpu"]["tests"]
    assert stages["loop"]["eager"]["tokens_per_s"] > 0 and stages["loop"]["compiled"]["tokens_per_s"] > 0
    assert "float8 compiled" not in stages["loop"]  # float8 needs a GPU of compute capability 8.9+
    assert stages["serving"]["engine_tokens_per_s"] > 0 and stages["serving"]["generate_tokens_per_s"] > 0


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_compiled_training_stage_runs_shardyard_train(tmp_path: Path) -> None:
    with ray_files_of_their_own() as ray_tmp:
        run = device_check(tmp_path, "train_compiled", ray_tmp)["train_compiled"]
    assert run["exit_code"] == 0 and run["tokens_per_s"] > 0, run


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_eager_training_stage_runs_and_its_relaunch_is_timed_in_phases(tmp_path: Path) -> None:
    with ray_files_of_their_own() as ray_tmp:
        stages = device_check(tmp_path, "train,relaunch", ray_tmp)
    assert stages["train"]["exit_code"] == 0 and stages["train"]["tokens_per_s"] > 0, stages["train"]
    relaunched = stages["relaunch"]
    assert relaunched["exit_code"] == 0 and relaunched["tokens_per_s"] > 0, relaunched
    assert {"command_s", "ray_start_s", "worker_start_s", "build_s", "verify_s", "load_s", "first_step_s",
            "since_command_s"} <= set(relaunched["startup"])
    assert relaunched["startup"]["load_s"] > 0  # it resumed from the first launch's checkpoint


@pytest.mark.timeout(120)
def test_every_training_stages_job_is_validated_before_any_stage_runs(tmp_path: Path) -> None:
    """With no budget nothing runs, yet each training stage's job was validated as `shardyard
    train` validates it (README's default job itself trains in tests/test_quick_start.py)."""
    stages = device_check(tmp_path, "train,relaunch,readme,train_compiled,train_float8", budget_s=0)
    assert {name: stage["job"]["config"] for name, stage in stages.items()} == {
        "train": "jobs/configs/llama_fsdp.yaml", "relaunch": "jobs/configs/llama_fsdp.yaml",
        "readme": "jobs/configs/gpt_ddp.yaml", "train_compiled": "jobs/configs/llama_fsdp.yaml",
        "train_float8": "jobs/configs/llama_fsdp.yaml"}
    assert stages["readme"]["job"] == {"config": "jobs/configs/gpt_ddp.yaml", "model": "gpt", "strategy": "ddp",
                                       "workers": 2, "steps": 4}, stages["readme"]
    assert stages["relaunch"]["job"]["steps"] == stages["train"]["job"]["steps"] + 2
