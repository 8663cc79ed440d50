"""Shared fixtures: one real Ray cluster per test session, started with `ray start --head`.

The cluster is ours alone (free ports, its own process session) and is stopped by killing that
session's processes, exactly the ones it started; `ray stop` would kill every Ray instance on the
machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shardyard.localdist import free_port

REPO = Path(__file__).resolve().parents[1]
# Ray 2.59+ clusters use token auth; clients (ray job submit, ray.init) must opt in to send it.
os.environ.setdefault("RAY_AUTH_MODE", "token")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test on the session's Ray cluster is marked `ray`: `pytest -m "not ray and not slow"`
    runs the parallel math, checkpoint and spec tests alone, in a few minutes."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(autouse=True)
def one_torch_thread_beside_the_cluster(request: pytest.FixtureRequest):
    """A test on the cluster computes its expected values in this process while Ray's processes
    hold the 2 cores: torch's second intra-op thread then waits at every parallel region for a
    core the cluster has (an 8-token greedy decode took 20 s instead of milliseconds). One thread."""
    if "ray_cluster" not in request.fixturenames:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class RayCluster:
    gcs_address: str
    dashboard_url: str


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    import ray

    port, dashboard = free_port(), free_port()
    log = tmp_path_factory.mktemp("ray") / "ray_start.log"
    ray_bin = Path(sys.executable).with_name("ray")
    # With token auth on, `ray start` needs a token and makes none (a fresh machine has none):
    # the command Ray's own error message gives creates ~/.ray/auth_token once, if missing.
    subprocess.run([str(ray_bin), "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)
    proc = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", f"--dashboard-port={dashboard}", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", "--num-cpus=4", "--disable-usage-stats"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        # As for a user with the venv activated: jobs' `python` is this interpreter.
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
    )
    cluster = RayCluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}")
    try:
        _wait_for_dashboard(cluster.dashboard_url, proc, log)
        ray.init(address=cluster.gcs_address, log_to_driver=True)
        yield cluster
    finally:
        ray.shutdown()
        # Every process the cluster started, at once: on SIGTERM the head node drains for up to
        # 30 s, and nothing of the session's work is left to drain.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def _wait_for_dashboard(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited early:\n{log.read_text()}")
        try:
            # Any answer means the server is up (with token auth it is a 401 without the token).
            if requests.get(f"{url}/api/version", timeout=2).status_code < 500:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"Ray dashboard did not come up at {url}:\n{log.read_text()}")
