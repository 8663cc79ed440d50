"""DeepSpeed's CPU communication op is JIT-compiled under torch's build lock file. A process killed
during that build leaves the lock behind; without shardyard's guard every later DeepSpeed start
waits for it forever (seen in a fresh virtual environment). Here a real build is killed mid-way
and the next start must build the op and return.

On a machine where the op is not built yet (a fresh one, as CI's) the test builds it where every
later DeepSpeed start looks (torch's default extensions directory), so the suite compiles it once,
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

    second = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not stale_locks(root)
    assert list(root.rglob(f"{OP_NAME}*.so")), "no op was built"
