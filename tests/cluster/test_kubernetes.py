"""The Kubernetes manifests (deploy/kuberay/) are what KubeRay accepts: each validates against
KubeRay's own CRD schema (../shared/kuberay-crds/, OpenAPI v3) with a JSON-schema validator, made
strict as `kubectl apply --validate=strict` is (a field the schema does not name is an error, not
silently pruned). The RayService's embedded Serve config is a Serve config the app accepts, and
the image they name is the one deploy/Dockerfile builds, at the Ray version they name."""

from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema
from helpers.repo import REPO


CRDS = REPO.parent / "shared" / "kuberay-crds"
MANIFESTS = {"rayjob.yaml": "ray.io_rayjobs.yaml", "rayservice.yaml": "ray.io_rayservices.yaml"}
pytestmark = pytest.mark.skipif(not CRDS.is_dir(), reason=f"KubeRay's CRDs are not at {CRDS}")


def strict(schema: dict) -> dict:
    """`schema` with unknown fields refused wherever it lists an object's fields and does not
    keep unknown ones (x-kubernetes-preserve-unknown-fields)."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def crd_of(crd_file: str) -> dict:
    return yaml.load((CRDS / crd_file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def validator(manifest: dict, crd_file: str) -> jsonschema.Validator:
    crd = crd_of(crd_file)
    assert manifest["kind"] == crd["spec"]["names"]["kind"]
    group, version = manifest["apiVersion"].split("/")
    assert group == crd["spec"]["group"]
    served = {v["name"]: v for v in crd["spec"]["versions"] if v["served"]}
    return jsonschema.Draft7Validator(strict(served[version]["schema"]["openAPIV3Schema"]))


def manifest(name: str) -> dict:
    return yaml.safe_load((REPO / "deploy" / "kuberay" / name).read_text())


@pytest.mark.parametrize("name", MANIFESTS)
def test_a_manifest_validates_against_kuberays_crd(name: str) -> None:
    errors = sorted(validator(manifest(name), MANIFESTS[name]).iter_errors(manifest(name)), key=str)
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_crd_check_refuses_a_misspelled_field_and_a_wrong_type(name: str) -> None:
    doc = manifest(name)
    cluster = doc["spec"].get("rayClusterSpec") or doc["spec"]["rayClusterConfig"]
    cluster["headGroupSpec"]["rayStartParam"] = {}  # misspelled
    cluster["workerGroupSpecs"][0]["replicas"] = "two"
    messages = [e.message for e in validator(doc, MANIFESTS[name]).iter_errors(doc)]
    assert any("rayStartParam" in m for m in messages) and any("'two' is not of type 'integer'" in m for m in messages)


def test_both_manifests_lock_the_cluster_down_and_use_the_projects_image() -> None:
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    ray_version = re.search(r"ARG RAY_VERSION=(\S+)", dockerfile).group(1)
    workdir = re.search(r"^WORKDIR (\S+)", dockerfile, re.M).group(1)
    for name in MANIFESTS:
        spec = manifest(name)["spec"]
        cluster = spec.get("rayClusterSpec") or spec["rayClusterConfig"]
        assert cluster["authOptions"]["mode"] == "token" and cluster["rayVersion"] == ray_version
        assert cluster["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"  # the job API stays inside
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        assert {c["image"] for g in groups for c in g["template"]["spec"]["containers"]} == {"shardyard:latest"}
    config = manifest("rayjob.yaml")["spec"]["entrypoint"].split()[2]
    assert config.startswith(workdir + "/") and (REPO / Path(config).relative_to(workdir)).is_file()



def test_every_rayservice_pod_takes_http_through_the_ingress_with_a_header_deadline() -> None:
    """The Serve controller reads the ingress settings on the head pod, each replica on its own pod;
    the deadline is deploy/serve-ingress.sh's, the one the launcher's clusters get."""
    ingress = (REPO / "deploy" / "serve-ingress.sh").read_text()
    deadline = re.search(r'TIMEOUT_CLIENT_S="\$\{SHARDYARD_HEADER_TIMEOUT_S:-(\d+)\}"', ingress).group(1)
    cluster = manifest("rayservice.yaml")["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", container["name"]
            assert env.get("RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S") == deadline, container["name"]

@pytest.mark.timeout(120)
def test_the_rayservice_serves_a_serve_config_the_app_accepts_for_the_rayjobs_run(tmp_path: Path) -> None:
    """Its arguments pass the app's own checks (Serve's schema drops unknown keys), against the run
    the RayJob writes (the default job's checkpoint, here at a local path): the model splits as
    the config says."""
    from shardyard.localdist import run_distributed
    from shardyard.serve.resolved import load_config
    from helpers.serving import save_default_job_checkpoint
    serve = yaml.safe_load(manifest("rayservice.yaml")["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    (app,) = serve["applications"]
    job_runs = manifest("rayjob.yaml")["spec"]["entrypoint"].split("checkpoint.storage_path=")[1].split()[0]
    assert app["args"]["checkpoint"] == f"{job_runs}/gpt_ddp"  # the run the RayJob trains
    run_dir = tmp_path / "gpt_ddp"
    run_distributed(save_default_job_checkpoint, 1, str(run_dir))  # one rank writes it as two would, smaller
    # The volume's path as it is here; the Secret as every pod's environment has it.
    pods = manifest("rayservice.yaml")["spec"]["rayClusterConfig"]
    for group in [pods["headGroupSpec"], *pods["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        secret = {e["name"]: e.get("valueFrom") for e in container["env"]}[app["args"]["auth"]["bearer_token_env"]]
        assert secret == {"secretKeyRef": {"name": "shardyard-api-key", "key": "api-key"}}
    os.environ[app["args"]["auth"]["bearer_token_env"]] = "a-secret-of-this-test"
    try:
        config = load_config({**app["args"], "checkpoint": str(run_dir)}, use_gpu=False)
    finally:
        del os.environ[app["args"]["auth"]["bearer_token_env"]]
    assert config.engine.num_shards == 2 and config.engine.sharding == "pipeline" and app["import_path"] == "serve_apps.gpt:app"


def test_the_rayjobs_pods_give_a_preempted_run_time_to_checkpoint() -> None:
    """SIGTERM checkpoints within checkpoint.preempt_timeout_s: every pod's grace period, and the
    head's wait before `ray job stop` sends SIGKILL (Ray's default is 3 s), are longer."""
    from shardyard.spec import CheckpointSpec

    preempt = CheckpointSpec().preempt_timeout_s
    cluster = manifest("rayjob.yaml")["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] > preempt
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert int({e["name"]: e["value"] for e in head["env"]}["RAY_JOB_STOP_WAIT_TIME_S"]) > preempt
