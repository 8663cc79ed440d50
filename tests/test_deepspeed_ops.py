"""DeepSpeed's CPU communication op is JIT-compiled under torch's build lock file, by the first
DeepSpeed start on a machine: a Ray Train worker. A worker killed during that build (a failed
worker, a stopped job) leaves the lock behind; without shardyard's guard every later DeepSpeed
start waits for it forever (seen in a fresh virtual environment). Here a Ray worker is killed
mid-build, compiler and all, and the next worker must build the op and return."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import ray

from shardyard.parallel.deepspeed_ops import ensure_deepspeed_ops, stale_locks


@pytest.mark.timeout(420)
def test_a_worker_killed_mid_build_does_not_stop_the_next_start(ray_cluster, tmp_path: Path) -> None:
    extensions, pid_file = tmp_path / "extensions", tmp_path / "worker.pid"

    def build_on_a_worker(pid_file: str) -> None:  # defined here: Ray ships it by value
        Path(pid_file).write_text(str(os.getpid()))
        ensure_deepspeed_ops()

    # A build directory of this test's own, so the op is built from nothing.
    build = ray.remote(build_on_a_worker).options(
        num_cpus=1, max_retries=0,
        runtime_env={"env_vars": {"TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu"}})
    first = build.remote(str(pid_file))
    deadline = time.monotonic() + 180
    while not (extensions.exists() and stale_locks(extensions)):  # the build has begun: torch holds its lock
        ready, _ = ray.wait([first], timeout=0.05)
        assert not ready and time.monotonic() < deadline, f"the build never started: {ready and ray.get(ready)}"
    worker = psutil.Process(int(pid_file.read_text()))
    for process in [*worker.children(recursive=True), worker]:  # the compiler with it
        process.send_signal(signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(first, timeout=60)
    assert stale_locks(extensions), "the killed build left no lock: nothing was tested"

    ray.get(build.remote(str(pid_file)), timeout=300)
    assert not stale_locks(extensions)
    assert list(extensions.rglob("deepspeed_shm_comm*.so")), "no op was built"
