"""The vLLM tests' apps: Serve's HTTP proxy on a free port, apps deployed and deleted around each
test, and a run of README's default job to serve."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardyard.localdist import free_port


@pytest.fixture(scope="module")
def serve_port(ray_cluster) -> Iterator[int]:
    """Serve's HTTP proxy on a free port, for this module's apps."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


@pytest.fixture
def serving(serve_port: int) -> Iterator[Callable[[str, dict], str]]:
    """A function that deploys an app and returns its base URL; the test's apps are deleted after
    it (their CPUs are what the next test's apps start on)."""
    from ray import serve

    from shardyard.serve.app.deployment import build_app

    deployed = []

    def deploy(name: str, args: dict) -> str:
        serve.run(build_app(args), name=name, route_prefix=f"/{name}")
        deployed.append(name)
        return f"http://127.0.0.1:{serve_port}/{name}"

    yield deploy
    for name in deployed:
        serve.delete(name)


@pytest.fixture(scope="module")
def default_job_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of README's default GPT (UTF-8 bytes as tokens, a 64-token context), as its job writes it."""
    from shardyard.localdist import run_distributed

    from helpers.serving import save_default_job_checkpoint
    run_dir = tmp_path_factory.mktemp("default_job")
    run_distributed(save_default_job_checkpoint, 1, str(run_dir))
    return run_dir
