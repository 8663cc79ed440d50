"""End to end, as README's "On a cluster" gives it and a user on this 2-core machine runs it:
`ray start --head --node-ip-address=127.0.0.1` (Ray's default ports, the machine's real CPUs, no
cluster of the test session's), then `ray job submit --working-dir . -- python jobs/train.py
--config ...`, `ray job status`, `ray job logs`; a job stopped mid-run (`ray job stop`) and
submitted again as `ray job submit ... -- shardyard train CONFIG` resumes where it stopped."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.buckets import Bucket
from helpers.user_shell import readme_ray_cluster
from shardyard.checkpoint.record import newest_name
from shardyard.train.callbacks import HOLD_ENV
from shardyard.checkpoint.loaders import find_latest
from shardyard.localdist import free_port
from shardyard.storage.events import read_events
from shardyard.train.metrics import read_metrics
from shardyard.storage.store import RunStorage
from helpers.repo import RAY, REPO, SHARDYARD

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
           entrypoint: list[str] = SCRIPT_JOB, working_dir: str = ".", py_modules: tuple[str, ...] = ()) -> str:
    runtime_env = {**({"env_vars": env} if env else {}), **({"py_modules": list(py_modules)} if py_modules else {})}
    runtime = ["--runtime-env-json", json.dumps(runtime_env)] if runtime_env else []
    deadline = time.monotonic() + 60
    while True:
        answer = ray_job(cluster, "submit", "--no-wait", "--working-dir", working_dir, *runtime, "--",
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


@pytest.mark.timeout(120)
def test_a_cluster_that_cannot_be_joined_is_refused_at_once_with_the_reason(cluster, tmp_path: Path) -> None:
    """`shardyard train` told to join a cluster it cannot: in a shell without README's
    `export RAY_AUTH_MODE=token`, refused with Ray's reason (the token); at an address nothing
    answers at, refused at once (Ray itself retried such an address for over ten minutes). Exit
    status 2 and no traceback, nothing trained."""
    unanswered = f"127.0.0.1:{free_port()}"
    no_token = {**cluster, "RAY_ADDRESS": "127.0.0.1:6379", "RAY_AUTH_MODE": "disabled",
                "RAY_NUM_REDIS_GET_RETRIES": "1"}  # Ray's tries at a refusing cluster: 20, a second apart
    errors = []
    for env in (no_token, {**cluster, "RAY_ADDRESS": unanswered}):
        started = time.monotonic()
        answer = subprocess.run([SHARDYARD, "train", "jobs/configs/gpt_ddp.yaml", "--set",
                                 f"checkpoint.storage_path={tmp_path}"], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=90)
        assert answer.returncode == 2 and "Traceback" not in answer.stderr, answer.stderr[-3000:]
        assert time.monotonic() - started < 60
        errors.append(answer.stderr)
    assert "could not join the Ray cluster at 127.0.0.1:6379: " in errors[0] and "token" in errors[0], errors[0]
    assert f"no Ray cluster answers at {unanswered}" in errors[1], errors[1]
    assert list(tmp_path.rglob("checkpoint_step_*")) == []


USERS_SCRIPT = '''"""A user's training script: their model from a package of theirs, their data and loss
from the directory beside this script, the spec a dict naming the functions themselves."""
import sys

from shardyard.api import fit, job

from nets import tiny_cnn
from vision import SyntheticImages, cross_entropy

SPEC = {
    "model": {"name": "module", "factory": tiny_cnn, "options": {"size": 8}},
    "data": {"name": "factory", "factory": SyntheticImages, "options": {"num_samples": 96, "size": 8}},
    "loss": {"factory": cross_entropy},
    "optim": {"name": "sgd", "lr": 0.2, "schedule": "constant"},
    "batch": {"global_batch_size": 16, "micro_batch_size": 4},
    "checkpoint": {"every_n_steps": 2},
    "run": {"name": "mine", "log_every": 1, "sample_ledger": True},
}

if __name__ == "__main__":
    print("trained to", fit(job(SPEC, sys.argv[1:])).checkpoint)
'''

USERS_NETS = '''from torch import nn


def tiny_cnn(channels: int = 4, classes: int = 10, size: int = 8) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(channels * size * size, classes))
'''


@pytest.mark.timeout(480)
def test_a_users_own_code_reaches_the_workers_through_the_runtime_environment(cluster, tmp_path: Path) -> None:
    """Code that is neither in the checkout nor installed: a script calling `shardyard.api.fit`,
    with the dataset and loss beside it, submitted with `--working-dir` and the model's package
    with `py_modules`, trains on 2 workers to step 2; then the same run goes on to step 4 on 1
    worker the way a notebook on the cluster does, `ray.init(runtime_env=...)` and `fit`. Every
    sample once across both."""
    from shardyard.data.ledger import audit

    project, packages = tmp_path / "project", tmp_path / "packages"
    (packages / "nets").mkdir(parents=True)
    (packages / "nets" / "__init__.py").write_text(USERS_NETS)
    project.mkdir()
    shutil.copy(REPO / "jobs" / "vision.py", project / "vision.py")
    (project / "train_mine.py").write_text(USERS_SCRIPT)
    runs = f"checkpoint.storage_path={tmp_path / 'runs'}"
    status, logs = wait_until_done(cluster, submit(
        cluster, [], entrypoint=["python", "train_mine.py", runs, "run.steps=2", "scaling.num_workers=2"],
        working_dir=str(project), py_modules=(str(packages / "nets"),)))
    assert re.search(r"succeeded", status, re.IGNORECASE) and "step 2/2" in logs, f"{status}\n{logs[-3000:]}"

    notebook = ("import sys, ray\n"
                f"sys.path.insert(0, {str(packages)!r})\n"  # where the notebook's kernel finds the package
                f"ray.init(address='auto', runtime_env={{'working_dir': '.', 'py_modules': [{str(packages / 'nets')!r}]}})\n"
                "from shardyard.api import fit, job\n"
                "from train_mine import SPEC\n"
                f"print('trained to', fit(job(SPEC, [{runs!r}, 'run.steps=4', 'scaling.num_workers=1'])).checkpoint)\n")
    done = subprocess.run([sys.executable, "-c", notebook], cwd=project, capture_output=True, text=True,
                          timeout=300, env=cluster)
    output = done.stdout + done.stderr
    run_dir = tmp_path / "runs" / "mine"
    assert done.returncode == 0 and f"trained to {run_dir / 'checkpoint_step_00000004'}" in output, output[-4000:]
    report = audit(run_dir, 96)
    assert report.exact and report.world_sizes == [2, 2, 1, 1], report
