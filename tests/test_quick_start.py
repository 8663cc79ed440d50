"""README's quick start as a user on this 2-core machine runs it: `shardyard train
jobs/configs/gpt_ddp.yaml` from the checkout with no Ray cluster running, so the command starts a
local Ray instance with this machine's CPUs. Only the run's length and storage are overridden
(`--set`, as README documents), to keep the test short and the checkout clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, ray_files_of_their_own, user_environment
from shardyard.train.checkpoint import find_latest
from shardyard.train.metrics import LOSS_PLOT, read_metrics

SHARDYARD = str(Path(sys.executable).with_name("shardyard"))


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_readme_default_job_trains_on_a_local_ray_it_starts(tmp_path: Path) -> None:
    command = [SHARDYARD, "train", "jobs/configs/gpt_ddp.yaml", "--set", "run.steps=12", "--set", "run.log_every=4",
               "--set", f"checkpoint.storage_path={tmp_path}"]
    with ray_files_of_their_own() as ray_tmp:
        done = subprocess.run(command, cwd=REPO, env=user_environment(ray_tmp), capture_output=True, text=True,
                              timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    run_dir = tmp_path / "gpt_ddp"
    assert "step 12/12" in output and "shardyard run 'gpt_ddp'" in output, output[-4000:]
    assert find_latest(run_dir).name == "checkpoint_step_00000012"
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [4, 8, 12] and {row["world_size"] for row in rows} == {2}
    assert (run_dir / LOSS_PLOT).stat().st_size > 0
