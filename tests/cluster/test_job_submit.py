"""End to end, as README's "On a cluster" gives it and a user on this 2-core machine runs it:
`ray start --head --node-ip-address=127.0.0.1` (Ray's default ports, the machine's real CPUs, no
cluster of the test session's), then `ray job submit --working-dir . -- python jobs/train.py
--config ...`, `ray job status`, `ray job logs`; a job stopped mid-run (`ray job stop`) and
submitted again as `ray job submit ... -- shardyard train CONFIG` resumes where it stopped."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.buckets import Bucket
from helpers.user_shell import readme_ray_cluster
from shardyard.checkpoint.record import newest_name
from shardyard.train.callbacks import HOLD_ENV
from shardyard.checkpoint.loaders import find_latest
from shardyard.storage.events import read_events
from shardyard.train.metrics import read_metrics
from shardyard.storage.store import RunStorage
from helpers.repo import RAY, REPO

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """The user's environment on README's cluster."""
    with readme_ray_cluster(REPO) as env:
        yield env


def ray_job(cluster: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`ray job ...` from the checkout, as README writes it (no address: the local cluster's)."""
    return subprocess.run([RAY, "job", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=cluster)


SCRIPT_JOB = ["python", "jobs/train.py", "--config", "jobs/configs/gpt_ddp.yaml"]


def submit(cluster: dict[str, str], overrides: list[str], env: dict[str, str] | None = None,
           entrypoint: list[str] = SCRIPT_JOB) -> str:
    runtime = ["--runtime-env-json", json.dumps({"env_vars": env})] if env else []
    deadline = time.monotonic() + 60
    while True:
        answer = ray_job(cluster, "submit", "--no-wait", "--working-dir", ".", *runtime, "--",
                         *entrypoint, *[arg for o in overrides for arg in ("--set", o)])
        # Right after `ray start` the node's job agent may not be up yet; Ray says to try again.
        if "No available agent" not in answer.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert answer.returncode == 0, answer.stderr + answer.stdout
    return re.search(r"raysubmit_\w+", answer.stdout + answer.stderr).group(0)


def wait_until_done(cluster: dict[str, str], job_id: str, timeout_s: float = 360) -> tuple[str, str]:
    """(status line, logs) once the job has succeeded, failed or been stopped."""
    deadline = time.monotonic() + timeout_s
    status = ""
    while time.monotonic() < deadline:
        answer = ray_job(cluster, "status", job_id)
        status = answer.stdout + answer.stderr  # the CLI prints the status line on stderr
        if re.search(r"succeeded|failed|stopped", status, re.IGNORECASE):
            break
        time.sleep(2)
    return status, ray_job(cluster, "logs", job_id).stdout


@pytest.mark.timeout(480)
def test_submitted_job_stopped_and_submitted_again_resumes_and_writes_outputs(cluster, tmp_path: Path) -> None:
    overrides = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
                 "data.name=synthetic", "run.steps=40", "run.log_every=10",
                 "checkpoint.every_n_steps=10", f"checkpoint.storage_path={tmp_path}", "run.name=again"]
    run_dir = tmp_path / "again"
    # The first job waits at its checkpoint of step 20 (until a release that never comes): it is
    # stopped mid-run whatever this machine's speed.
    first = submit(cluster, overrides, {HOLD_ENV: "20"})
    deadline = time.monotonic() + 240
    while not any(e["event"] == "held" for e in read_events(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert find_latest(run_dir) is not None, ray_job(cluster, "logs", first).stdout[-3000:]
    stop = ray_job(cluster, "stop", first)
    assert stop.returncode == 0, stop.stderr + stop.stdout
    status, _ = wait_until_done(cluster, first, 120)
    assert re.search(r"stopped", status, re.IGNORECASE), status
    stopped_at = int(find_latest(run_dir).name.rsplit("_", 1)[1])
    assert stopped_at == 20

    # Submitted again in the other shape README gives: the `shardyard train` command itself.
    status, logs = wait_until_done(cluster, submit(cluster, overrides,
                                                   entrypoint=["shardyard", "train", "jobs/configs/gpt_ddp.yaml"]))
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-3000:]}"
    starts = [e for e in read_events(run_dir) if e["event"] == "start"]
    assert len(starts) == 2 and starts[1]["restored_step"] == stopped_at, starts
    assert "step 40/40" in logs and "shardyard run 'again'" in logs
    assert (run_dir / "checkpoint_step_00000040" / "trainer_state.pt").is_file()
    logged = [row["step"] for row in read_metrics(run_dir)]
    assert logged == list(range(10, 41, 10)), logged  # each step once, across both jobs
    assert (run_dir / "loss_curve.png").is_file()


@pytest.mark.timeout(480)
def test_jobs_prepare_data_into_a_bucket_and_train_from_and_into_it(cluster, bucket: Bucket, tmp_path: Path) -> None:
    """Object storage on README's cluster: a submitted `shardyard prepare` (a Ray Data job) writes
    token shards to s3://bucket, then README's training job reads them there and writes its
    checkpoints, metrics and events there. The endpoint and credentials reach the jobs (and their
    Ray Data and Ray Train workers) only through `--runtime-env-json`, as a user passes them."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    prepare = tmp_path / "prepare.yaml"
    prepare.write_text(json.dumps({"source": {"path": str(docs), "format": "text"}, "tokenizer": {"name": "bytes"},
                                   "output": {"path": "s3://bucket/data", "shard_tokens": 4096}}))
    status, logs = wait_until_done(cluster, submit(cluster, [], bucket.env, ["shardyard", "prepare", str(prepare)]))
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-3000:]}"
    assert bucket.fs.exists("bucket/data/index.json") and bucket.fs.glob("bucket/data/train-*.bin"), logs[-3000:]

    overrides = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
                 "data.name=shards", "data.path=s3://bucket/data", "run.steps=20", "run.log_every=10",
                 "checkpoint.every_n_steps=10", "checkpoint.storage_path=s3://bucket/runs", "run.name=bucket"]
    status, logs = wait_until_done(cluster, submit(cluster, overrides, bucket.env))
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-3000:]}"
    run = "s3://bucket/runs/bucket"
    assert newest_name(RunStorage(run)) == "checkpoint_step_00000020"
    assert [row["step"] for row in read_metrics(run)] == [10, 20]
    assert [e["event"] for e in read_events(run) if e["event"] == "start"] == ["start"]


@pytest.mark.timeout(240)
def test_a_job_with_a_relative_storage_path_is_refused_with_the_fix(cluster) -> None:
    """README's job without an absolute storage path would train into Ray's copy of the working
    directory (deleted with Ray's session, and not the run the user resumes or serves): refused
    before anything starts, naming the setting that works."""
    status, logs = wait_until_done(cluster, submit(cluster, [], entrypoint=["shardyard", "train",
                                                                            "jobs/configs/gpt_ddp.yaml"]), 180)
    assert re.search(r"failed", status, re.IGNORECASE), f"{status}\n{logs[-3000:]}"
    assert "checkpoint.storage_path 'runs' is relative" in logs, logs[-3000:]
    assert "--set checkpoint.storage_path=$PWD/runs" in logs and "Traceback" not in logs, logs[-3000:]
