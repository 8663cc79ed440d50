"""`serve run` as a user runs it, from the repository root, with a Serve config file that
imports `serve_apps.gpt:app`; a real HTTP client against it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import yaml

from conftest import REPO
from shardyard.localdist import free_port, run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.spec import parse_spec
from shardyard.train import checkpoint
from shardyard.train.checkpoint import TrainState
from test_strategies import job

SERVE = str(Path(sys.executable).with_name("serve"))


def save_untrained(rank: int, world: int, out: str) -> None:
    spec = parse_spec(job({"strategy": "ddp"}, 1, 4))
    torch.manual_seed(spec.run.seed)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    # Committed, as training leaves it.
    checkpoint.CheckpointManager(out, keep=1).save(engine, TrainState(0, 0, world), spec, metrics={})


@pytest.mark.timeout(300)
def test_serve_run_with_a_config_file_answers_http(ray_cluster, tmp_path: Path) -> None:
    run_distributed(save_untrained, 1, str(tmp_path / "run"))
    port = free_port()
    config = yaml.safe_load((REPO / "serve_apps" / "config.yaml").read_text())
    config["http_options"]["port"] = port
    # A run directory, as training leaves it: the app serves its latest checkpoint.
    config["applications"][0]["args"]["checkpoint"] = str(tmp_path / "run")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([SERVE, "run", str(path)], cwd=REPO, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address})
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                answer = requests.post(f"http://127.0.0.1:{port}/v1/completions",
                                       json={"prompt": "def ", "max_tokens": 5}, timeout=30)
                if answer.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(2)
        assert answer.json()["tokens"] == 5
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()["status"] == "ok"
        # The config file asks for adaptive batching: a batch size was measured and put in force.
        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert float(re.search(r"^shardyard_max_batch_size (\S+)", metrics, re.M).group(1)) >= 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
