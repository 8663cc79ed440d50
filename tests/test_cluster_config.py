"""The cluster launcher configs are real: cluster.yaml (AWS) and deploy/onprem.yaml (Ray's local
provider) pass Ray's own schema and semantic checks (the private helpers `ray up` uses; pinned to
the installed Ray, so re-check on upgrades), and neither exposes an unauthenticated job API."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from conftest import REPO

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
    mounted = {remote.replace("/home/ubuntu", "~"): local for remote, local in config["file_mounts"].items()}
    if mounted.get("~/.ray/auth_token") != "~/.ray/auth_token":
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
