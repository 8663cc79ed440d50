"""End to end, as a user runs it: `ray start --head` (the session cluster), then
`ray job submit --working-dir . -- python jobs/train.py --config ...`, then `ray job status`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

RAY = str(Path(sys.executable).with_name("ray"))


def ray_job(cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RAY, "job", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "RAY_ADDRESS": cluster.dashboard_url, "RAY_AUTH_MODE": "token"},
    )


@pytest.mark.timeout(420)
def test_ray_job_submit_trains_and_writes_outputs(ray_cluster, tmp_path: Path) -> None:
    overrides = ["model.n_layer=2", "model.n_embd=64", "run.steps=12", "run.log_every=4",
                 "checkpoint.every_n_steps=6", f"checkpoint.storage_path={tmp_path}",
                 "run.name=submitted"]
    submit = ray_job(ray_cluster, "submit", "--no-wait", "--working-dir", ".", "--",
                     "python", "jobs/train.py", "--config", "jobs/configs/gpt_ddp.yaml",
                     *[arg for o in overrides for arg in ("--set", o)])
    assert submit.returncode == 0, submit.stderr + submit.stdout
    job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)

    deadline = time.monotonic() + 360
    status = ""
    while time.monotonic() < deadline:
        answer = ray_job(ray_cluster, "status", job_id)
        status = answer.stdout + answer.stderr  # the CLI prints the status line on stderr
        if re.search(r"succeeded|failed|stopped", status, re.IGNORECASE):
            break
        time.sleep(3)
    logs = ray_job(ray_cluster, "logs", job_id).stdout
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-3000:]}"

    assert "step 12/12" in logs and "shardyard run 'submitted'" in logs
    run_dir = tmp_path / "submitted"
    assert (run_dir / "checkpoint_step_00000012" / "trainer_state.pt").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 6, 8, 12]
    assert (run_dir / "loss_curve.png").is_file()
