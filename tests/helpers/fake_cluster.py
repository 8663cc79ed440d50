"""A Ray cluster whose worker nodes Ray's own autoscaler adds and removes, on this one machine.

Ray's fake multi-node provider (`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`):
the autoscaler is the real one (the same resource-demand scheduler, idle timeout and launch loop
as on a cloud), and a node it launches is a real raylet started on this machine with the node
type's resources. Ray Train's elastic policy asks it for `max_workers` through Ray's autoscaling
coordinator, as it does on a cloud.

The cluster keeps its files in a RAY_TMPDIR of its own and is stopped by killing exactly the
processes that name that directory (`ray stop` would stop every Ray instance on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from shardyard.localdist import free_port

RAY = str(Path(sys.executable).with_name("ray"))
NODE_ID_ENV = "RAY_OVERRIDE_NODE_ID_FOR_TESTING"  # the fake provider names each node's raylet with it


def processes_of(ray_tmp: str) -> list[psutil.Process]:
    """Every process whose command line or environment names `ray_tmp`, and their children (this
    one excepted)."""
    owned: list[psutil.Process] = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            if proc.pid == os.getpid():
                continue
            if (any(ray_tmp in arg for arg in proc.info["cmdline"] or ())
                    or (proc.info["environ"] or {}).get("RAY_TMPDIR") == ray_tmp):
                owned += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    return owned


def stop_processes_of(ray_tmp: str) -> None:
    """Kills `processes_of(ray_tmp)`."""
    kill_all(processes_of(ray_tmp))


def kill_all(processes: list[psutil.Process]) -> None:
    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=30)


class FakeAutoscalingCluster:
    """A head with `head_resources` and up to `max_nodes` autoscaled nodes of `node_resources`,
    each removed once idle for `idle_timeout_s`."""

    def __init__(self, head_resources: dict[str, float], node_resources: dict[str, float],
                 max_nodes: int, idle_timeout_s: float = 15) -> None:
        self.ray_tmp = tempfile.mkdtemp(prefix="sy-", dir="/tmp")  # short: Ray's socket paths live under it
        self.port = free_port()
        self.gcs_address = f"127.0.0.1:{self.port}"
        self.head_resources = head_resources
        self.config = {
            "cluster_name": "fake", "max_workers": max_nodes, "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_timeout_s / 60,
            # Nodes come up as raylets, with nothing to set up over SSH: no updaters, and no
            # relaunch when the config's hash differs. They all share this machine's address, so
            # the autoscaler tells them apart by node id (as in Ray's own fake-cluster example).
            "provider": {"type": "fake_multinode", "gcs_address": self.gcs_address,
                         "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "auth": {"ssh_user": "ray"},
            "available_node_types": {
                "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
                "autoscaled": {"resources": node_resources, "node_config": {},
                               "min_workers": 0, "max_workers": max_nodes},
            },
            "head_node_type": "ray.head.default",
            **{key: {} for key in ("file_mounts",)},
            **{key: [] for key in ("cluster_synced_files", "rsync_exclude", "rsync_filter",
                                   "initialization_commands", "setup_commands", "head_setup_commands",
                                   "worker_setup_commands", "head_start_ray_commands",
                                   "worker_start_ray_commands")},
            "file_mounts_sync_continuously": False,
        }
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
                    "RAY_TMPDIR": self.ray_tmp, "RAY_AUTH_MODE": "token"}

    def __enter__(self) -> FakeAutoscalingCluster:
        config = Path(self.ray_tmp) / "autoscaling.json"
        config.write_text(json.dumps(self.config))
        extra = {k: v for k, v in self.head_resources.items() if k != "CPU"}
        subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)
        started = subprocess.run(
            [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}",
             f"--num-cpus={self.head_resources.get('CPU', 0)}", f"--resources={json.dumps(extra)}",
             f"--autoscaling-config={config}", f"--dashboard-port={free_port()}",
             f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
             "--disable-usage-stats"],
            env={**self.env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"},
            capture_output=True, text=True, timeout=180)
        if started.returncode != 0:
            self.__exit__()
            raise RuntimeError(f"the autoscaling cluster did not start:\n{started.stdout}{started.stderr}")
        return self

    def __exit__(self, *exc: object) -> None:
        stop_processes_of(self.ray_tmp)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def autoscaled_raylets(self) -> dict[str, int]:
        """The nodes the autoscaler launched and that are running: node id -> its raylet's pid
        (read from the processes, so that this process need not join the cluster)."""
        raylets = {}
        for proc in psutil.process_iter(["name", "environ", "cmdline"]):
            try:
                environ = proc.info["environ"] or {}
                if (proc.info["name"] == "raylet" and environ.get("RAY_TMPDIR") == self.ray_tmp
                        and NODE_ID_ENV in environ and "--head" not in proc.info["cmdline"]):
                    raylets[environ[NODE_ID_ENV]] = proc.pid
            except psutil.Error:
                continue
        return raylets

    def hold_autoscaler(self) -> None:
        """Stops Ray's autoscaler (the head's monitor process, which launches the nodes) until
        `release_autoscaler`: a cloud slow to provision, so a run surely starts before its nodes come."""
        self._autoscaler().suspend()

    def release_autoscaler(self) -> None:
        self._autoscaler().resume()

    def _autoscaler(self) -> psutil.Process:
        for proc in processes_of(self.ray_tmp):
            try:
                if any(arg.endswith("autoscaler/_private/monitor.py") for arg in proc.cmdline()):
                    return proc
            except psutil.Error:
                continue
        raise LookupError(f"no autoscaler runs for the cluster in {self.ray_tmp}")

    def reclaim(self, node_id: str) -> None:
        """The cloud takes the instance back: every process of that node dies at once."""
        victims = []
        for proc in psutil.process_iter(["environ"]):
            try:
                if (proc.info["environ"] or {}).get(NODE_ID_ENV) == node_id:
                    victims += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                continue
        if not victims:
            raise LookupError(f"no process of node {node_id} on this machine")
        kill_all(victims)


def wait_for(condition: Callable[[], object], timeout_s: float, message: str | Callable[[], str]) -> None:
    """Polls `condition` until it holds; TimeoutError with `message` after `timeout_s` (a callable
    is asked then, so that it can say how things stood at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(message() if callable(message) else message)
        time.sleep(0.2)
