"""Shared fixtures: one real Ray cluster per test session, started with `ray start --head`.

The cluster is ours alone (free ports, its own process session) and is stopped by killing that
session's processes, exactly the ones it started; `ray stop` would kill every Ray instance on the
machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shardyard.localdist import free_port
from shardyard.serve.executor.model_thread import one_intra_op_thread

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the tests share the benchmarks' cluster helpers
RAY = str(Path(sys.executable).with_name("ray"))
# Ray 2.59+ clusters use token auth; clients (ray job submit, ray.init) must opt in to send it.
os.environ.setdefault("RAY_AUTH_MODE", "token")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test on the session's Ray cluster is marked `ray`: `pytest -m "not ray"` runs the
    parallel math, checkpoint, spec and drill tests alone, in a few minutes."""
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
    with one_intra_op_thread():
        yield


@dataclass
class RayCluster:
    gcs_address: str
    dashboard_url: str


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    import ray

    port, dashboard = free_port(), free_port()
    log = tmp_path_factory.mktemp("ray") / "ray_start.log"
    # With token auth on, `ray start` needs a token and makes none (a fresh machine has none):
    # the command Ray's own error message gives creates ~/.ray/auth_token once, if missing.
    subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)
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
        ray.init(address=cluster.gcs_address, log_to_driver=True)
        yield cluster
    finally:
        ray.shutdown()
        # Every process the cluster started, at once: on SIGTERM the head node drains for up to
        # 30 s, and nothing of the session's work is left to drain.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        # What `ray stop` does besides: forget the cluster's address, which `ray.init()` without
        # one (`shardyard serve` after README's test command) would otherwise wait for. By port:
        # the record may name the node's own IP. (Imported here: shardyard.cluster imports Ray, which
        # reads RAY_AUTH_MODE once, when imported, and this module sets it above.)
        from shardyard.cluster import cluster_record

        record = cluster_record()
        if record.exists() and record.read_text().strip().rpartition(":")[2] == str(port):
            record.unlink()


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


def user_environment(ray_tmp: str) -> dict[str, str]:
    """The user's shell on this machine, for README's commands: the venv's scripts on PATH, no Ray
    address or auth mode from this test session, and Ray's files in a directory of their own, so a
    command cannot find the session's cluster (ray.init() joins the newest cluster started on the
    machine) and starts or joins only its own, as on a machine with none."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    return {**env, "RAY_TMPDIR": ray_tmp, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}


@contextmanager
def ray_files_of_their_own() -> Iterator[str]:
    """A RAY_TMPDIR for one README command; short, since Ray's socket paths live under it. Every
    process whose command line or environment names it (and their children: workers, job drivers)
    is killed on the way out: `ray stop` would stop the session's cluster too. (Ray's client server
    names neither its session's directory nor a parent once `ray start` has exited: only its
    environment tells whose it is.)"""
    from fake_cluster import stop_processes_of

    ray_tmp = tempfile.mkdtemp(prefix="sy-", dir="/tmp")
    try:
        yield ray_tmp
    finally:
        stop_processes_of(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@contextmanager
def readme_ray_cluster(cwd: Path) -> Iterator[dict[str, str]]:
    """README's local cluster, exactly: `ray get-auth-token --generate`, `export RAY_AUTH_MODE=token`,
    `ray start --head --node-ip-address=127.0.0.1` (this machine's real CPUs, Ray's default ports).
    Yields the user's environment for the commands that follow (`ray job submit`, ...)."""
    import socket

    for port in (6379, 8265, 10001, 52365):  # the fixed defaults README's `ray start` binds
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} (Ray's default) is taken"
    with ray_files_of_their_own() as ray_tmp:
        env = {**user_environment(ray_tmp), "RAY_AUTH_MODE": "token"}
        for command in (["get-auth-token", "--generate"], ["start", "--head", "--node-ip-address=127.0.0.1"]):
            started = subprocess.run([RAY, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
            assert started.returncode == 0, f"ray {' '.join(command)}:\n{started.stdout}{started.stderr}"
        yield env



@dataclass
class Bucket:
    fs: Any  # s3fs's filesystem, paths as "bucket/..."
    env: dict[str, str]  # the endpoint and credentials, as a node's environment or a job's runtime env holds them


@contextmanager
def s3_bucket(monkeypatch: pytest.MonkeyPatch, conditional_writes: bool = True) -> Iterator[Bucket]:
    """s3://bucket on a fresh S3 server (moto's standalone server: the S3 protocol over HTTP on a
    local port). Its endpoint and credentials are in this process's environment, as on a cluster
    node (local ranks inherit them); a submitted job gets them from its runtime env. Without
    `conditional_writes` the endpoint is a proxy that drops `If-None-Match` on its way to moto:
    an S3-compatible store that ignores conditional writes."""
    import logging

    import fsspec
    import requests
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server logs a line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    # moto keeps every server's buckets in one state per process: start from an empty store.
    requests.post(f"http://127.0.0.1:{port}/moto-api/reset", timeout=30).raise_for_status()
    proxy = None if conditional_writes else unconditional_proxy(port)
    endpoint = f"http://127.0.0.1:{proxy.server_address[1] if proxy else port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "shardyard",
           "AWS_SECRET_ACCESS_KEY": "shardyard", "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # fsspec reuses a filesystem made with the same arguments: one made for an earlier test's
    # server would still talk to that server's port.
    s3 = fsspec.get_filesystem_class("s3")
    s3.clear_instance_cache()
    fs = s3(use_listings_cache=False)
    fs.mkdir("bucket")
    try:
        yield Bucket(fs, env)
    finally:
        s3.clear_instance_cache()
        if proxy is not None:
            proxy.shutdown()
        server.stop()


def unconditional_proxy(port: int) -> Any:
    """An HTTP proxy on a thread, forwarding every request to 127.0.0.1:`port` without its
    `If-None-Match` header (the header moto, like S3, honours for a create-if-absent PUT)."""
    import http.client
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() != "if-none-match"}
            upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    with s3_bucket(monkeypatch) as made:
        yield made


@pytest.fixture
def conditionless_bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    with s3_bucket(monkeypatch, conditional_writes=False) as made:
        yield made


def private_file(path: Path, text: str) -> Path:
    """A file only this user may read and write (mode 600), as token files must be."""
    path.write_text(text)
    path.chmod(0o600)
    return path


@contextmanager
def served_by_uvicorn(app: Any, root_path: str = "") -> Iterator[str]:
    """`app` (ASGI) on a real socket, served by uvicorn on a thread of this process (behind a proxy
    that mounts it at `root_path`, when given): its base URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                            root_path=root_path))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def trickled_bodies(url: str, path: str, token: str, count: int, declared: int = 1024) -> Iterator[list[Any]]:
    """`count` slowloris clients: each sends a POST's whole head with the token, then one byte of
    the body it declared, then nothing. The open sockets, closed on leaving."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    sockets = []
    try:
        for _ in range(count):
            sock = socket.create_connection((where.hostname, where.port), timeout=30)
            sock.sendall(f"POST {where.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {where.hostname}\r\n"
                         f"Authorization: Bearer {token}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{{".encode())
            sockets.append(sock)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()
