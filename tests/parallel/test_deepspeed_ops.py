"""DeepSpeed's CPU communication op is JIT-compiled under torch's build lock file. A process killed
during that build leaves the lock behind; without shardyard's guard every later DeepSpeed start
waits for it forever (seen in a fresh virtual environment). Here a real build is killed mid-way
and the next start must build the op and return; then a start whose PATH finds another ninja
first must find it built, not build it again.

On a machine where the op is not built yet (a fresh one, as CI's) the test builds it where every
later DeepSpeed start looks (this environment's extensions directory), so the suite compiles it once,
not twice; where it is built already, in a directory of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardyard.parallel.deepspeed_ops import OP_NAME, extensions_root, stale_locks

BUILD = "from shardyard.parallel.deepspeed_ops import ensure_deepspeed_ops; ensure_deepspeed_ops()"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_build_killed_mid_way_does_not_stop_the_next_start(tmp_path: Path) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    root = extensions_root()  # where DeepSpeed starts look, as this environment sets it
    if list(root.rglob(f"{OP_NAME}*.so")):
        root = tmp_path
        env["TORCH_EXTENSIONS_DIR"] = str(root)
    first = subprocess.Popen([sys.executable, "-c", BUILD], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not stale_locks(root):  # the build has begun: torch holds its lock file
        assert first.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the compiler with it
    first.wait()
    assert stale_locks(root), "the killed build left no lock: nothing was tested"

    # The environment's bin first on PATH, as in Ray's workers: its ninja would run the build.
    on_path = {**env, "PATH": os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])}
    second = subprocess.run([sys.executable, "-c", BUILD], env=on_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not stale_locks(root)
    built = {op: op.stat().st_mtime_ns for op in root.rglob(f"{OP_NAME}*.so")}
    assert built, "no op was built"

    # A start without it on PATH (a `python` run by its path) finds the op built: it must not run
    # the system's ninja, which reads the other's build log as stale and builds everything again.
    off_path = {**env, "PATH": os.pathsep.join(d for d in env["PATH"].split(os.pathsep)
                                               if Path(d) != Path(sys.executable).parent)}
    third = subprocess.run([sys.executable, "-c", BUILD], env=off_path, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert {op: op.stat().st_mtime_ns for op in root.rglob(f"{OP_NAME}*.so")} == built, "built again"
