"""`ray up deploy/onprem.yaml` for real: two machines made on this one (tests/helpers/cluster_hosts.py),
launched, used and taken down through the real `ray` and `serve` command lines, as docs/clusters.md
says: `ray up`, `ray dashboard`, `serve deploy` of the cluster's serving app on both machines (HAProxy
on the head forwarding to a replica on the worker; a connection without headers closed), `ray job
submit` of README's training job, `serve deploy` of the run it wrote and a query, `ray down`. The
worker machine is powered off mid-run and the run goes on at the world size what is left can hold,
with every sample used exactly once.

The config is deploy/onprem.yaml with the addresses and SSH key filled in, and its installing
steps (a virtual environment, pip from PyPI and PyTorch's index) replaced by a link to this
checkout's environment: these machines reach no package index, and share this one's disk.
Everything else (file mounts, the PATH line, token auth, every start command) runs as written.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from helpers.cluster_hosts import Host, Hosts, require
from shardyard.localdist import free_port
from shardyard.train.callbacks import held_at as held
from shardyard.train.callbacks import release
from helpers.repo import DEFAULT_JOB as CONFIG
from helpers.elastic import EVERY, check_run, events, job
from helpers.fake_cluster import wait_for
from helpers.repo import RAY, REPO

SERVE = str(Path(sys.executable).with_name("serve"))
STEPS = 100

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def launcher_config(hosts: list[Host], key: Path) -> dict:
    config = yaml.safe_load((REPO / "deploy" / "onprem.yaml").read_text())
    config["provider"].update(head_ip=hosts[0].ip, worker_ips=[h.ip for h in hosts[1:]])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    installing = [c for c in config["setup_commands"] if "pip install" in c or "-m venv" in c]
    assert len(installing) == 4, config["setup_commands"]  # the config changed: re-check this substitution
    config["setup_commands"] = [f"ln -sfn {Path(sys.prefix)} ~/shardyard-env"] + [
        c for c in config["setup_commands"] if c not in installing]
    return config


class Client:
    """This machine as the user's laptop: its own home (its Ray token there), the launcher's CLIs."""

    def __init__(self, root: Path) -> None:
        self.home = root / "client"
        self.home.mkdir()
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
                    "HOME": str(self.home), "RAY_AUTH_MODE": "token"}

    def run(self, *command: str, timeout_s: float = 300) -> str:
        done = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def token(self) -> str:
        return (self.home / ".ray" / "auth_token").read_text().strip()

    def serve_token(self) -> str:
        """The serving API's token, made as the cluster configs say (`ray up` copies it to every node)."""
        path = self.home / ".shardyard" / "serve_token"
        if not path.exists():  # as `umask 077 && openssl rand -hex 32 > ...` makes it: only its owner reads it
            path.parent.mkdir()
            path.write_text(os.urandom(32).hex() + "\n")
            path.chmod(0o600)
        return path.read_text().strip()


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[list[Host], Path]]:
    reason = require()
    if reason:
        pytest.skip(f"cannot make machines for the cluster launcher here: {reason}")
    made = Hosts(tmp_path, 2)
    with made as hosts:
        yield hosts, made.client_key


def test_onprem_cluster_launched_used_and_taken_down(hosts, tmp_path: Path) -> None:
    machines, key = hosts
    head, worker = machines
    config = tmp_path / "onprem.yaml"
    config.write_text(yaml.safe_dump(launcher_config(machines, key)))
    client = Client(tmp_path)
    client.run(RAY, "get-auth-token", "--generate")
    client.serve_token()

    client.run(RAY, "up", "-y", str(config), timeout_s=600)
    # The head's autoscaler (Ray's local provider) sets up and starts the worker over SSH.
    wait_for(lambda: worker.processes("raylet"), 300, "the worker machine never started Ray")
    port = free_port()
    tunnel = subprocess.Popen([RAY, "dashboard", str(config), "--port", str(port)], cwd=REPO, env=client.env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    api = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {client.token()}"}
    try:
        wait_for(lambda: answers(f"{api}/api/version", auth), 120, "the dashboard tunnel never answered")
        wait_for(lambda: len(alive_nodes(api, auth)) == 2, 120, "the worker machine never joined")
        assert_locked_down(head, api)
        serve_across_the_machines(client, api, head, worker, tmp_path)

        run_dir = train_through_a_worker_loss(client, api, worker, tmp_path / "storage")
        check_run(run_dir, [4, 2], STEPS)

        deploy(client, api, cluster_serve_config(run_dir, **{"engine.cpus_per_shard": 0.75}), tmp_path)  # the head's 2 CPUs
        answer = complete(f"http://{head.ip}:8000", client)
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8, answer
    finally:
        tunnel.kill()
        down = subprocess.run([RAY, "down", "-y", str(config)], cwd=REPO, env=client.env,
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    # `ray down` ran `ray stop` on the head: nothing of Ray's is left there, nor HAProxy on port 8000.
    assert not head.processes("raylet|gcs_server|haproxy"), head.processes("raylet|gcs_server|haproxy")


def answers(url: str, headers: dict[str, str]) -> bool:
    try:
        return requests.get(url, headers=headers, timeout=5).ok
    except requests.RequestException:
        return False


def alive_nodes(api: str, auth: dict[str, str]) -> list[dict]:
    listed = requests.get(f"{api}/api/v0/nodes", headers=auth, params={"limit": 100}, timeout=30).json()
    return [n for n in listed["data"]["result"]["result"] if n["state"] == "ALIVE"]


def assert_locked_down(head: Host, api: str) -> None:
    """The job API runs code: without the token it refuses, and it is not on the network at all."""
    submit = {"entrypoint": "echo pwned"}
    refused = requests.post(f"{api}/api/jobs/", json=submit, timeout=30)
    assert refused.status_code == 401, (refused.status_code, refused.text)
    forged = requests.post(f"{api}/api/jobs/", json=submit, headers={"Authorization": "Bearer " + "0" * 64}, timeout=30)
    assert forged.status_code in (401, 403), (forged.status_code, forged.text)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{head.ip}:8265/api/version", timeout=10)


def train_through_a_worker_loss(client: Client, api: str, worker: Host, storage: Path) -> Path:
    """README's training job, made small and elastic (2 to 4 workers), submitted as docs/clusters.md
    does. It starts on 4 (2 CPUs per machine), waits at its checkpoint of step EVERY while the
    worker machine is powered off, and finishes on the head's 2."""
    overrides = [item for item in job(storage, "onprem", "ddp", STEPS) if not item.startswith("scaling.resources")]
    command = [RAY, "job", "submit", "--address", api, "--no-wait", "--working-dir", ".",
               "--runtime-env-json", json.dumps({"env_vars": {"SHARDYARD_HOLD_AT": str(EVERY)}}),
               "--", "shardyard", "train", str(CONFIG.relative_to(REPO))]
    for item in overrides:
        command += ["--set", item]
    submitted = client.run(*command)
    job_id = re.search(r"raysubmit_\w+", submitted).group(0)
    run_dir = storage / "onprem"
    status = lambda: job_status(api, client, job_id)  # noqa: E731
    try:
        wait_for(lambda: held(run_dir, EVERY) or status() in ("FAILED", "STOPPED"), 300,
                 f"the run never reached step {EVERY}")
        assert held(run_dir, EVERY)["world_size"] == 4, events(run_dir)
        assert any("RayTrainWorker" in p for p in worker.processes("ray::")), "no training worker on the worker"
        worker.power_off()
    finally:
        release(run_dir, EVERY)
    wait_for(lambda: status() in ("SUCCEEDED", "FAILED", "STOPPED"), 420, "the job did not finish")
    assert status() == "SUCCEEDED", client.run(RAY, "job", "logs", "--address", api, job_id)[-4000:]
    return run_dir


def job_status(api: str, client: Client, job_id: str) -> str:
    reply = requests.get(f"{api}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {client.token()}"},
                         timeout=30)
    return reply.json()["status"]


def serve_across_the_machines(client: Client, api: str, head: Host, worker: Host, root: Path) -> None:
    """serve_apps/cluster.yaml before training, on a Hugging Face model directory: two replicas of 2
    CPUs each (one shard, decoded in the replica's process), so one on each machine. HAProxy on
    the head forwards requests to the replica on the worker (its own counters say so) and closes a
    connection that sends no headers (408 at deploy/serve-ingress.sh's 15 s). Then the app is shut
    down, leaving the CPUs to training."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = root / "storage" / "tiny-llama"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=32)).save_pretrained(model)
    deploy(client, api, cluster_serve_config(model, num_replicas=2, **{"engine.num_shards": 1, "engine.cpus_per_shard": 1.5}), root)
    url = f"http://{head.ip}:8000"
    with socket.create_connection((head.ip, 8000)) as slow:  # half a request's headers, then silence
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        refused = requests.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert refused.status_code == 401, (refused.status_code, refused.text)  # the token is asked for
        for _ in range(8):
            assert complete(url, client)["usage"]["completion_tokens"] == 8
        slow.settimeout(60)
        answer = slow.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and slow.recv(4096) == b"", answer  # and closed
    auth = {"Authorization": f"Bearer {client.token()}"}
    on_worker = replicas_on(api, auth, worker.ip)
    assert len(on_worker) == 1 and len(replicas_on(api, auth, head.ip)) == 1, on_worker  # one per machine
    servers = haproxy_servers(head)  # HAProxy names a replica's server after the replica
    assert sum(int(s["stot"] or 0) for s in servers if s["svname"].endswith(tuple(on_worker))) > 0, servers
    client.run(SERVE, "shutdown", "-y", "--address", api)


def replicas_on(api: str, auth: dict[str, str], ip: str) -> set[str]:
    """`-<id>` of each live Serve replica on the machine at `ip`, from Ray's state API (a replica's
    actor is named SERVE_REPLICA::<app>#<deployment>#<id>)."""
    node_ips = {n["node_id"]: n["node_ip"] for n in alive_nodes(api, auth)}
    listed = requests.get(f"{api}/api/v0/actors", headers=auth, timeout=30, params={
        "limit": 1000, "filter_keys": "state", "filter_predicates": "=", "filter_values": "ALIVE"}).json()
    return {"-" + a["name"].rsplit("#", 1)[1] for a in listed["data"]["result"]["result"]
            if (a.get("name") or "").startswith("SERVE_REPLICA::") and node_ips.get(a["node_id"]) == ip}


def haproxy_servers(head: Host) -> list[dict[str, str]]:
    """The servers HAProxy on the head forwards to, from its stats page (port 8404, Ray's default):
    each one's name (`svname`) and the requests it has been sent (`stot`). deploy/serve-ingress.sh
    binds the page to the head's loopback interface: it is read from inside the head's network,
    and refused from the cluster's."""
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{head.ip}:8404/stats;csv", timeout=30)
    read = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8404/stats;csv', timeout=30).read().decode())"
    page = subprocess.run(["ip", "netns", "exec", head.name, sys.executable, "-c", read], capture_output=True,
                          text=True, timeout=60, check=True).stdout.lstrip("# ")
    return [{key: row[key] for key in ("pxname", "svname", "stot")}
            for row in csv.DictReader(io.StringIO(page)) if row["svname"] not in ("FRONTEND", "BACKEND")]


def cluster_serve_config(checkpoint: Path, **args: object) -> dict:
    config = yaml.safe_load((REPO / "serve_apps" / "cluster.yaml").read_text())
    config["applications"][0]["args"].update(checkpoint=str(checkpoint), **args)
    return config


def deploy(client: Client, api: str, config: dict, root: Path) -> None:
    """`serve deploy` through the dashboard tunnel, as docs/clusters.md says."""
    path = root / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    client.run(SERVE, "deploy", str(path), "--address", api)
    last: dict = {}

    def settled() -> bool:
        last.clear()
        last.update(serve_status(client, api))
        return last["status"] in ("RUNNING", "DEPLOY_FAILED")

    wait_for(settled, 300, lambda: f"the app never came up: {last}")
    assert last["status"] == "RUNNING", last


def complete(url: str, client: Client) -> dict:
    query = {"prompt": "def ", "max_tokens": 8, "temperature": 0}  # the models' contexts: 16 and 32
    reply = requests.post(f"{url}/v1/completions", json=query, timeout=120,
                          headers={"Authorization": f"Bearer {client.serve_token()}"})
    assert reply.status_code == 200, (reply.status_code, reply.text)
    return reply.json()


def serve_status(client: Client, api: str) -> dict:
    """The app's part of `serve status`: its status and, where deploying failed, the message. A
    status that takes over a minute is no status yet: on a loaded 2-core head the dashboard once
    answered `serve status` later than that while the app deployed, and the deploy's own deadline
    decides."""
    try:
        done = subprocess.run([SERVE, "status", "--address", api], cwd=REPO, env=client.env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return {"status": "", "message": "`serve status` gave no answer within 60 s"}
    applications = yaml.safe_load(done.stdout or "{}") or {}
    return {"status": "", **(applications.get("applications") or {}).get("shardyard", {})}
