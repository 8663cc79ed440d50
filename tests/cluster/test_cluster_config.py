"""The cluster launcher configs are real: cluster.yaml (AWS) and deploy/onprem.yaml (Ray's local
provider) pass Ray's own schema and semantic checks (the private helpers `ray up` uses; pinned to
the installed Ray, so re-check on upgrades), and neither exposes an unauthenticated job API."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from helpers.repo import REPO


CONFIGS = ["cluster.yaml", "deploy/onprem.yaml"]


def read(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


@pytest.mark.parametrize("name", CONFIGS)
def test_cluster_configs_validate_against_rays_schema(name: str) -> None:
    prepared = prepare_config(read(name))
    validate_config(prepared)
    assert any("pip install -e" in c for c in prepared["setup_commands"])
    assert any("ray start --head" in c for c in prepared["head_start_ray_commands"])


def test_the_aws_config_has_a_cpu_head_and_gpu_workers() -> None:
    prepared = prepare_config(read("cluster.yaml"))
    gpu = prepared["available_node_types"]["gpu_worker"]
    assert gpu["min_workers"] <= gpu["max_workers"] and prepared["head_node_type"] == "head"


def test_schema_check_is_not_vacuous() -> None:
    config = read("cluster.yaml")
    config["available_node_types"]["gpu_worker"]["min_workerz"] = 1
    with pytest.raises(Exception, match="min_workerz"):
        validate_config(prepare_config(config))


def mounted(config: dict) -> dict[str, str]:
    """The config's file mounts, node paths written from the home directory (~)."""
    return {remote.replace("/home/ubuntu", "~"): local for remote, local in config["file_mounts"].items()}


def exposure(config: dict) -> list[str]:
    """What in a cluster config would let someone reach the job API without the token."""
    problems = []
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if re.search(r"\bray start\b", c)]
        problems += [f"{key}: no `ray start`"] if not starts else []
        problems += [f"{key}: without token auth: {c}" for c in starts if "RAY_AUTH_MODE=token" not in c]
        if key == "head_start_ray_commands":
            problems += [f"dashboard not on localhost: {c}" for c in starts
                         if not re.search(r"--dashboard-host[= ](127\.0\.0\.1|localhost)(\s|$)", c)]
    if mounted(config).get("~/.ray/auth_token") != "~/.ray/auth_token":
        problems.append("the client's token is not copied to the nodes")
    return problems


@pytest.mark.parametrize("name", CONFIGS)
def test_no_cluster_config_exposes_an_unauthenticated_job_api(name: str) -> None:
    """Every node starts Ray with token authentication, all sharing the token copied from the
    machine that runs `ray up`; the dashboard (and its job-submission API) listens on the head's
    localhost only."""
    assert exposure(read(name)) == []


def test_the_lock_down_check_is_not_vacuous() -> None:
    config = read("cluster.yaml")
    config["head_start_ray_commands"] = [c.replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
                                         for c in config["head_start_ray_commands"]]
    config["worker_start_ray_commands"] = [c.replace("RAY_AUTH_MODE=token ", "")
                                           for c in config["worker_start_ray_commands"]]
    del config["file_mounts"]["/home/ubuntu/.ray/auth_token"]
    assert len(exposure(config)) == 3


def without_header_deadline(config: dict) -> list[str]:
    """`ray start` commands not preceded by deploy/serve-ingress.sh (Serve's HAProxy ingress)."""
    sourced = r"\. ~/shardyard/deploy/serve-ingress\.sh &&.*\bray start\b"
    return [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[key]
            if re.search(r"\bray start\b", c) and not re.search(sourced, c)]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_node_takes_http_through_the_ingress_with_a_header_deadline(name: str) -> None:
    """The Serve controller reads the ingress settings on the head, each replica on its own node."""
    config = read(name)
    assert without_header_deadline(config) == []
    assert mounted(config).get("~/.shardyard/serve_token") == "~/.shardyard/serve_token"  # serve_apps/cluster.yaml's
    config["worker_start_ray_commands"] = [c.replace(". ~/shardyard/deploy/serve-ingress.sh && ", "")
                                           for c in config["worker_start_ray_commands"]]
    assert len(without_header_deadline(config)) == 1


def source_ingress(files: Path) -> subprocess.CompletedProcess:
    """As on a node, where `python3` is the interpreter shardyard and Ray were installed into."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(["bash", "-c", f". {REPO / 'deploy' / 'serve-ingress.sh'} && env"],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": path, "SHARDYARD_HAPROXY_FILES": str(files)})


def test_the_ingress_settings_keep_haproxys_files_private(tmp_path: Path) -> None:
    done = source_ingress(tmp_path / "h")
    assert done.returncode == 0, done.stderr
    env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] == "15"
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"] == str(tmp_path / "h" / "admin.sock")
    assert stat.S_IMODE((tmp_path / "h").stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_the_ingress_settings_refuse_a_directory_another_user_made(tmp_path: Path) -> None:
    """Another user who made the directory first could reach HAProxy's admin socket: Ray does not start."""
    squatted = tmp_path / "h"
    squatted.mkdir(mode=0o777)
    os.chown(squatted, 65534, 65534)
    done = source_ingress(squatted)
    assert done.returncode == 1 and "belongs to another user" in done.stderr, done


def readme_cluster_setup() -> list[str]:
    """The lines of README's "On a cluster" block that run once on the client, before any Ray."""
    block = (REPO / "README.md").read_text().split("## On a cluster", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0] for line in block.splitlines() if "# once" in line]


@pytest.mark.timeout(60)
def test_readme_makes_every_local_file_the_cluster_configs_copy_and_keeps_them(tmp_path: Path) -> None:
    """`ray up` stops with a FileNotFoundError traceback when a file_mounts source is missing: on
    a client that followed only README, every one exists; run again, the tokens stay the same."""
    setup = readme_cluster_setup()
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def run_setup() -> dict[str, str]:
        for line in setup:
            subprocess.run(["bash", "-ec", line], env=env, check=True, capture_output=True, timeout=30)
        return {local: (tmp_path / local[2:]).read_text() for name in CONFIGS for local in read(name)["file_mounts"].values()
                if local.startswith("~/")}

    made = run_setup()
    assert set(made) == {"~/.ray/auth_token", "~/.shardyard/serve_token"} and all(made.values())
    assert oct((tmp_path / ".shardyard" / "serve_token").stat().st_mode & 0o777) == "0o600"
    assert run_setup() == made
