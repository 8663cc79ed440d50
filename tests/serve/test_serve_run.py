"""README's serving commands exactly as a user on this machine runs them: `shardyard serve
runs/gpt_ddp` (README's quick start) and `serve run serve_apps/config.yaml` (docs/serving.md) from
the checkout after the default training job, with no Ray cluster running, so each starts a local
Ray instance with this machine's CPUs (2 here, as on the machine README documents); a real HTTP
client against it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from helpers.user_shell import ray_files_of_their_own, user_environment
from shardyard.localdist import run_distributed
from helpers.serving import metric
from helpers.serving import save_default_job_checkpoint
from helpers.repo import REPO, SHARDYARD

SERVE = str(Path(sys.executable).with_name("serve"))
README_URL = "http://127.0.0.1:8000"  # serve_apps/config.yaml's address, as README gives it


# docs/serving.md's way to give `serve run` a header deadline: Serve's HAProxy ingress, turned on in
# the command's environment (15 s there; 3 here, to wait less).
HAPROXY_HEADER_DEADLINE_S = 3
HAPROXY_HEADER_DEADLINE = {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                           "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(HAPROXY_HEADER_DEADLINE_S)}


@pytest.mark.ray
@pytest.mark.timeout(420)
@pytest.mark.parametrize("ingress", [{}, HAPROXY_HEADER_DEADLINE], ids=["serve-proxy", "haproxy"])
def test_readme_serving_command_answers_http_on_a_two_core_machine(tmp_path: Path, ingress: dict[str, str]) -> None:
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 (README's) is taken on this machine"
    # The checkout as README leaves it: serve_apps/ and the default job's run directory.
    shutil.copytree(REPO / "serve_apps", tmp_path / "serve_apps", ignore=shutil.ignore_patterns("__pycache__"))
    run_distributed(save_default_job_checkpoint, 1, str(tmp_path / "runs" / "gpt_ddp"))
    with ray_files_of_their_own() as ray_tmp:
        answer_readme_requests(tmp_path, ray_tmp, ingress)
    # Ctrl-C stopped Serve before Ray: no HAProxy is left holding the port.
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "something still listens on port 8000"


def first_answer(proc: subprocess.Popen, body: dict, timeout_s: float = 240) -> requests.Response:
    """The first 200 to README's completion request while the command starts (its output, if it
    exits first or takes too long)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = requests.post(f"{README_URL}/v1/completions", json=body, timeout=30)
            if answer.status_code == 200:
                return answer
        except requests.ConnectionError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(2)


def answer_readme_requests(checkout: Path, ray_tmp: str, ingress: dict[str, str]) -> None:
    proc = subprocess.Popen([SERVE, "run", "serve_apps/config.yaml"], cwd=checkout, start_new_session=True,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=user_environment(ray_tmp) | ingress)
    try:
        answer = first_answer(proc, {"prompt": "def ", "max_tokens": 5})
        assert answer.json()["usage"]["completion_tokens"] == 5
        if ingress:  # as tests/cli/test_serve_command.py checks `shardyard serve`'s deadline
            with socket.create_connection(("127.0.0.1", 8000)) as slow:  # half a request's headers, then silence
                slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                slow.settimeout(2 * HAPROXY_HEADER_DEADLINE_S + 5)
                answer = slow.recv(4096)
                assert answer.startswith(b"HTTP/1.1 408") and slow.recv(4096) == b"", answer  # and closed
        assert requests.get(f"{README_URL}/healthz", timeout=10).json()["status"] == "ok"
        # The official OpenAI client, as README shows it: completions, chat, streaming.
        from openai import OpenAI

        client = OpenAI(base_url=f"{README_URL}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["gpt_ddp"]  # the run's name
        whole = client.completions.create(model="gpt_ddp", prompt="def ", max_tokens=8, temperature=0)
        assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
        streamed = client.completions.create(model="gpt_ddp", prompt="def ", max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text
        chat = client.chat.completions.create(model="gpt_ddp", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, seed=1)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
        # The config file asks for the engine: its prefill budget was measured and put in force.
        metric(README_URL, "ray_shardyard_prefill_token_budget", "shardyard", lambda n: n >= 1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the user's Ctrl-C: serve run stops its local Ray
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_readme_quick_start_serve_command_answers_its_query_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """`.venv/bin/shardyard serve runs/gpt_ddp`, then README's curl (no model named, a sampled
    completion), then Ctrl-C: the command exits 0 and the local Ray it started goes with it."""
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 (README's) is taken on this machine"
    run_distributed(save_default_job_checkpoint, 1, str(tmp_path / "runs" / "gpt_ddp"))
    with ray_files_of_their_own() as ray_tmp:
        proc = subprocess.Popen([SHARDYARD, "serve", "runs/gpt_ddp"], cwd=tmp_path, start_new_session=True, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=user_environment(ray_tmp))
        try:
            first_answer(proc, {"prompt": "def main(", "max_tokens": 40, "temperature": 0.8})  # up and answering
            # README's query line itself, run as a user runs it (curl's own request and headers).
            (query,) = [line for line in (REPO / "README.md").read_text().splitlines()
                        if line.startswith("curl -s 127.0.0.1:8000/v1/completions")]
            answer = json.loads(subprocess.run(query, shell=True, capture_output=True, text=True, timeout=120).stdout)
            assert answer["usage"]["completion_tokens"] <= 40 and answer["model"] == "gpt_ddp", answer
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=90) == 0, proc.stdout.read()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
