"""cluster.yaml is a real cluster-launcher config: it passes Ray's own schema and semantic checks
(the private helpers `ray up` uses; pinned to the installed Ray, so re-check on upgrades)."""

from __future__ import annotations

import copy

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from conftest import REPO


@pytest.fixture()
def cluster_config() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_validates_against_ray_schema(cluster_config: dict) -> None:
    prepared = prepare_config(copy.deepcopy(cluster_config))
    validate_config(prepared)
    gpu = prepared["available_node_types"]["gpu_worker"]
    assert gpu["min_workers"] <= gpu["max_workers"]
    assert prepared["head_node_type"] == "head"
    assert any("pip install -e" in c for c in prepared["setup_commands"])
    assert any("ray start --head" in c for c in prepared["head_start_ray_commands"])


def test_schema_check_is_not_vacuous(cluster_config: dict) -> None:
    cluster_config["available_node_types"]["gpu_worker"]["min_workerz"] = 1
    with pytest.raises(Exception, match="min_workerz"):
        validate_config(prepare_config(cluster_config))
