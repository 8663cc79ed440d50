"""Experiment tracking (train/tracking.py): a run files its metrics and resolved spec in a real
MLflow tracking server the test starts (`mlflow server` on a SQLite store), and in Weights &
Biases' offline files; launching the run again goes on in the same tracked run. Training runs in
plain torch.distributed processes: Ray adds nothing to what is tested here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from shardyard.localdist import free_port, run_distributed
from shardyard.spec import parse_spec
from shardyard.train.metrics import read_metrics
from helpers.oracle import SGD, job, train, with_storage

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("mlflow")
    url = f"http://127.0.0.1:{free_port()}"
    log = open(root / "server.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1",
         "--port", url.rsplit(":", 1)[1], "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:  # not listening yet, or listening and still starting up
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # its workers take 5 s to stop gracefully; nothing here needs that
        server.wait(30)
        log.close()


def tracked(tmp_path: Path, steps: int, run: dict) -> dict:
    raw = with_storage(job({"strategy": "ddp"}, 1, 4, SGD), tmp_path, steps=steps)  # rank 0 logs: one is enough
    return raw | {"run": {**raw["run"], **run}}


def test_a_run_files_its_loss_mfu_and_config_in_mlflow_and_a_relaunch_goes_on_in_the_same_run(
        mlflow_server: str, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    settings = {"loggers": ["tensorboard", "mlflow"], "tracking_uri": mlflow_server, "experiment": "tracked",
                "peak_tflops": 0.5}  # a CPU's peak given by the user: MFU is reported against it
    run_distributed(train, 1, tracked(tmp_path, 3, settings))
    run_distributed(train, 1, tracked(tmp_path, 5, settings))  # the same run, longer

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("tracked")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the relaunch went on in the first launch's MLflow run
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    rows = read_metrics(tmp_path / "run")
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert loss == [(r["step"], pytest.approx(r["loss"])) for r in rows] and [s for s, _ in loss] == [1, 2, 3, 4, 5]
    mfu = client.get_metric_history(run.info.run_id, "train/mfu")
    assert len(mfu) == 5 and all(0 < m.value < 1 for m in mfu)
    assert {"train/grad_norm", "train/model_tflops_per_s", "train/peak_memory_gib"} <= set(run.data.metrics)
    params = run.data.params
    assert params["parallelism.strategy"] == "ddp" and params["optim.name"] == "sgd"
    assert params["run.steps"] == "3" and params["model.n_layer"] == "4"  # the first launch's spec


def test_a_tracking_server_outage_mid_run_is_reported_and_training_goes_on(mlflow_server: str, tmp_path: Path,
                                                                          monkeypatch, capsys) -> None:
    """metrics.jsonl is the record: a tracker that cannot take a row is said once, and the rows
    keep being written (here the MLflow client is pointed at a closed port mid-run)."""
    from mlflow import MlflowClient

    from shardyard.train.metrics import MetricsLog

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    spec = parse_spec(tracked(tmp_path, 4, {"loggers": ["mlflow"], "tracking_uri": mlflow_server,
                                            "experiment": "outage"}))
    log = MetricsLog(spec, resume_step=0)
    (tracker,) = log.trackers
    log.append({"step": 1, "loss": 3.0})
    tracker.client = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")  # the server is gone
    log.append({"step": 2, "loss": 2.5})
    log.append({"step": 3, "loss": 2.0})
    log.close()  # the server still down at the end: said, and the run still succeeds
    out = capsys.readouterr().out
    assert out.count("did not take step") == 1 and "MLflow could not end its run" in out, out
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_weights_and_biases_offline_files_a_run_and_a_relaunch_resumes_it(tmp_path: Path) -> None:
    """W&B's tracker, driven as rank 0 drives it. Offline, W&B keeps a run in one record file
    with no public reader: its JSON values are checked in the file's bytes."""
    from shardyard.train.tracking import WandB

    spec = parse_spec(tracked(tmp_path, 4, {"loggers": ["wandb"], "experiment": "tracked"}))
    first = WandB(spec)
    first.log({"step": 1, "loss": 2.4375, "mfu": 0.1875, "val_loss": 2.8125, "epoch": 0.5})
    assert first.run.offline and first.run.project == "tracked"
    assert first.run.config["optim"]["name"] == "sgd" and first.run.config["parallelism"]["strategy"] == "ddp"
    run_id = first.run.id
    first.close()
    again = WandB(spec)  # a relaunch of the same run goes on in the same W&B run
    assert again.run.id == run_id
    again.close()
    launches = sorted((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(launches) == 2
    records = next(launches[0].glob("*.wandb")).read_bytes()
    for logged in (b"train/loss", b"2.4375", b"train/mfu", b"0.1875", b"validation/loss", b"2.8125"):
        assert logged in records, logged
    assert b"epoch" not in records  # the scalars trackers show, not every field of a row


def test_a_tracker_that_is_not_installed_is_refused_before_any_worker_starts(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"wandb named but not installed: pip install 'shardyard\[tracking\]'"):
        parse_spec({"run": {"loggers": ["tensorboard", "wandb"]}})
