"""Shared fixtures: one real Ray cluster per test session, started with `ray start --head`.

The cluster is ours alone (free ports, its own process session) and is stopped by killing that
session's processes, exactly the ones it started; `ray stop` would kill every Ray instance on the
machine.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardyard.localdist import free_port
from shardyard.serve.executor.model_thread import one_intra_op_thread
from helpers.repo import RAY
from helpers.buckets import Bucket, s3_bucket

# Ray 2.59+ clusters use token auth; clients (ray job submit, ray.init) must opt in to send it.
os.environ.setdefault("RAY_AUTH_MODE", "token")


# README's commands, run as a user runs them, bind Ray's and Serve's fixed default ports (6379, 8265,
# 8000): these modules run one after another, on one worker (each checks that the ports are free).
ON_DEFAULT_PORTS = frozenset({"tests/test_quick_start.py", "tests/test_gpu_check.py", "tests/cluster/test_job_submit.py",
                              "tests/cli/test_serve_command.py", "tests/serve/test_serve_run.py", "tests/pool/test_pool.py"})


def module_of(nodeid: str) -> str:
    return nodeid.partition("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test on the session's Ray cluster is marked `ray`: `pytest -m "not ray"` runs the
    parallel math, checkpoint, spec and drill tests alone, in a few minutes.

    Modules are handed to pytest-xdist's workers longest first, so that no long one starts last
    while the other worker idles: those on Ray before the rest, and among each, those whose tests
    may run longest (their timeouts) first."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    default_timeout = float(config.getini("timeout") or 0)
    longest: dict[str, tuple[bool, float]] = {}
    for item in items:
        marker = item.get_closest_marker("timeout")
        allowed = float(marker.args[0]) if marker and marker.args else default_timeout
        on_ray, most = longest.get(module_of(item.nodeid), (False, 0.0))
        longest[module_of(item.nodeid)] = (on_ray or item.get_closest_marker("ray") is not None, max(most, allowed))
    items.sort(key=lambda item: (not longest[module_of(item.nodeid)][0], -longest[module_of(item.nodeid)][1]))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hooks: absent without it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core, at most four. Much of a test's time is waiting (for Ray to
    start workers, a run to reach a step, an app to swap weights), which another worker's tests
    fill: on a 2-core machine two workers ran the suite in 42m15s against 54m29s in one session,
    once idle serving shards stopped holding the cores (a compiled graph's readers poll)."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """The suite runs on pytest-xdist's workers (`-n`), each a session with a Ray cluster of its
    own. A module is one unit of work, so that its module-scoped runs and apps are made once; the
    modules on README's default ports are one unit together."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = module_of(nodeid)
            return "on default ports" if module in ON_DEFAULT_PORTS else module

    return ByModule(config, log)


@pytest.fixture(autouse=True)
def one_torch_thread_beside_other_work(request: pytest.FixtureRequest):
    """A test computes its expected values in this process while other processes hold the cores
    (the session's other pytest-xdist worker, Ray's processes): torch's second intra-op thread then
    waits at every parallel region for a core that is busy elsewhere (an 8-token greedy decode took
    20 s instead of milliseconds; a 1,000-step oracle replay ran past a test's timeout). One thread."""
    beside_others = (int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
                     or request.node.get_closest_marker("ray") is not None)
    if not beside_others:
        yield
        return
    with one_intra_op_thread():
        yield


@dataclass
class RayCluster:
    gcs_address: str
    dashboard_url: str


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    import ray

    # With token auth on, `ray start` needs a token and makes none (a fresh machine has none):
    # the command Ray's own error message gives creates ~/.ray/auth_token once, if missing. One
    # worker at a time: two making it at once on a fresh machine would start clusters whose tokens differ.
    with open(Path(tempfile.gettempdir()) / "shardyard-tests-ray-token.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)
    proc, port, cluster = _start_head(tmp_path_factory.mktemp("ray") / "ray_start.log")
    try:
        ray.init(address=cluster.gcs_address, log_to_driver=True)
        yield cluster
    finally:
        ray.shutdown()
        _kill_head(proc)
        # What `ray stop` does besides: forget the cluster's address, which `ray.init()` without
        # one (`shardyard serve` after README's test command) would otherwise wait for. By port:
        # the record may name the node's own IP. (Imported here: shardyard.cluster imports Ray, which
        # reads RAY_AUTH_MODE once, when imported, and this module sets it above.)
        from shardyard.cluster import cluster_record

        record = cluster_record()
        if record.exists() and record.read_text().strip().rpartition(":")[2] == str(port):
            record.unlink()


def _start_head(log: Path, tries: int = 2) -> tuple[subprocess.Popen, int, RayCluster]:
    """`ray start --head` on free ports, up when its dashboard answers. A free port can be taken
    between free_port() and Ray's bind (the suite's workers and the vLLM tests' session start
    clusters at once): a head that exits early is started again, once, on new ports."""
    for attempt in itertools.count(1):
        port, dashboard = free_port(), free_port()
        # Every port Ray would otherwise take at a fixed default (the client server's 10001, the
        # dashboard agent's 52365) is a free one: README's `ray start --head` runs beside this cluster.
        proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={port}", f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}",
             f"--dashboard-agent-listen-port={free_port()}", "--include-dashboard=true",
             "--dashboard-host=127.0.0.1", "--disable-usage-stats"],
            # No --num-cpus: Ray counts this machine's cores, as `ray start --head` does for a user (2
            # on CI). Tests that train and serve at once size workers and shards to fit, as a user must.
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            # As for a user with the venv activated: jobs' `python` is this interpreter.
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
        )
        cluster = RayCluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}")
        try:
            _wait_for_dashboard(cluster.dashboard_url, proc, log)
            return proc, port, cluster
        except RuntimeError:  # it exited early: its log is in the error
            _kill_head(proc)
            if attempt == tries:
                raise
            print(f"ray start exited early; starting it again on other ports:\n{log.read_text()}", flush=True)


def _kill_head(proc: subprocess.Popen) -> None:
    """Every process the cluster started, at once: on SIGTERM the head node drains for up to 30 s,
    and nothing of the session's work is left to drain. (Its session may be gone already: a head
    that exited early took its processes with it.)"""
    with suppress(ProcessLookupError):
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


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    with s3_bucket(monkeypatch) as made:
        yield made


@pytest.fixture
def conditionless_bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    with s3_bucket(monkeypatch, conditional_writes=False) as made:
        yield made

