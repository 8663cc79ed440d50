"""README's commands as a user on this machine runs them: the user's shell environment, Ray's files
in a directory of their own (so a command finds no cluster but its own), README's local cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from helpers.fake_cluster import stop_processes_of, wait_for
from helpers.repo import RAY


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
    wait_for(lambda: not default_ports_taken(), 60,
             lambda: f"Ray's default ports stayed taken (README's `ray start` binds them): {default_ports_taken()}")
    with ray_files_of_their_own() as ray_tmp:
        env = {**user_environment(ray_tmp), "RAY_AUTH_MODE": "token"}
        for command in (["get-auth-token", "--generate"], ["start", "--head", "--node-ip-address=127.0.0.1"]):
            started = subprocess.run([RAY, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
            assert started.returncode == 0, f"ray {' '.join(command)}:\n{started.stdout}{started.stderr}"
        yield env


def default_ports_taken() -> dict[int, str]:
    """The fixed defaults README's `ray start --head` binds that something listens on, each with
    the command line holding it (a local Ray of an earlier test may still be exiting)."""
    defaults = (6379, 8265, 10001, 52365)
    taken: dict[int, str] = {}
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port in defaults:
            try:
                taken[conn.laddr.port] = " ".join(psutil.Process(conn.pid).cmdline())[:200] if conn.pid else "?"
            except psutil.Error:
                taken[conn.laddr.port] = "?"
    return taken
