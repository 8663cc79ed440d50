"""Serving that follows training live: an app serving a run directory swaps in each checkpoint the
run commits, between engine iterations, while a client streams; a checkpoint whose weights are
not finite is refused and never answers. The checkpoints are README's default GPT, each step's
weights drawn from its own seed, written by the real CheckpointManager into one run directory as
training writes them.

Checked: no request fails across three swaps; within each stream the fingerprint (`<run>@<step>`)
never goes backwards; after a swap the answer equals the new weights decoded alone (no key or
value cached under the old weights is read, the prompt's own prefix-cache blocks included); the
poisoned checkpoint is counted as refused and the served step stays; /admin/rollback and
/admin/promote step back and forth with the bearer token only, the poisoned step refused there
too; a checkpoint whose logged validation loss is worse than the served one's is refused, a better
one served.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from conftest import REPO
from shardyard.checkpoint.events import METRICS_FILE, JsonLines
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.record import checkpoint_name
from shardyard.checkpoint.store import RunStorage
from shardyard.localdist import free_port, run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.serve.generation import Completion, decode, encode, generate
from shardyard.spec import load_spec
from test_serve import TOKEN as SERVE_TEST_TOKEN
from test_serve import metric

PROMPT = "def main():\n    "


def commit_checkpoint(rank: int, world: int, run_dir: str, step: int, poisoned: bool) -> None:
    """The default job's checkpoint of `step`, its weights drawn from seed `step` (poisoned: one
    weight NaN, as a diverged run leaves it)."""
    spec = load_spec(REPO / "jobs" / "configs" / "gpt_ddp.yaml")
    torch.manual_seed(step)
    model = build_model(spec.model)
    if poisoned:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
    CheckpointManager(run_dir, keep=3).save(build_engine(spec, model, torch.device("cpu")),
                                            TrainState(step, 0, world), spec)


def commit(run_dir: Path, step: int, poisoned: bool = False) -> None:
    run_distributed(commit_checkpoint, 1, str(run_dir), step, poisoned)


TOKEN = SERVE_TEST_TOKEN  # the one test_serve.metric sends to /metrics
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def served(url: str) -> dict:
    return requests.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"][0]


def wait_for_step(url: str, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while served(url)["served_step"] != step:
        assert time.monotonic() < deadline, f"step {step} never served: {served(url)}"
        time.sleep(0.2)


class StreamingClient(threading.Thread):
    """Streams greedy completions one after another until stopped; keeps every status and each
    stream's fingerprints in order."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.statuses, self.streams = url, threading.Event(), [], []

    def run(self) -> None:
        while not self.stop.is_set():
            with requests.post(f"{self.url}/v1/completions", stream=True, timeout=60, headers=AUTH,
                               json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}) as reply:
                self.statuses.append(reply.status_code)
                prints = [json.loads(line[6:]).get("system_fingerprint") for line in reply.iter_lines(decode_unicode=True)
                          if line.startswith("data: {")]
                self.streams.append(prints)


def alone(checkpoint: Path) -> str:
    model = load_model(checkpoint).eval()
    return decode(generate(torch.no_grad()(model), [Completion(encode(PROMPT), 12)], 64)[0])


@pytest.mark.timeout(420)
def test_a_served_run_swaps_in_new_checkpoints_without_a_failed_request(ray_cluster, tmp_path: Path) -> None:
    from ray import serve

    from shardyard.serve.app import build_app

    run_dir = tmp_path / "gpt_ddp"
    commit(run_dir, 10)
    (tmp_path / "token").write_text(TOKEN)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"checkpoint": str(run_dir), "num_shards": 2, "cpus_per_shard": 0.5, "max_batch_size": 4,
                         "follow_interval_s": 0.5, "request_timeout_s": 60,
                         "bearer_token_file": str(tmp_path / "token")}), name="follow_app", route_prefix="/f")
    url = f"http://127.0.0.1:{port}/f"
    client = StreamingClient(url)
    try:
        assert served(url)["system_fingerprint"] == "gpt_ddp@10"
        complete = lambda: requests.post(f"{url}/v1/completions", timeout=60, headers=AUTH,  # noqa: E731
                                         json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
        before = complete()  # its prompt's blocks are now in the prefix cache, made by step 10's weights
        assert before["choices"][0]["text"] == alone(run_dir / checkpoint_name(10))
        client.start()
        for step in (20, 30, 40):
            commit(run_dir, step)
            wait_for_step(url, step)
        after = complete()
        assert after["system_fingerprint"] == "gpt_ddp@40"
        assert after["choices"][0]["text"] == alone(run_dir / checkpoint_name(40))
        assert after["choices"][0]["text"] != before["choices"][0]["text"]  # the weights did change

        commit(run_dir, 50, poisoned=True)  # a diverged run's checkpoint: committed, never served
        metric(url, "ray_shardyard_weight_swaps_refused_total", "follow_app", lambda n: n >= 1)
        assert served(url)["served_step"] == 40 and complete()["system_fingerprint"] == "gpt_ddp@40"
        assert find_latest(run_dir).name == checkpoint_name(50)
        metric(url, "ray_shardyard_weight_swaps_total", "follow_app", lambda n: n == 3)

        # An operator steps back and forth, through the same gate, with the token only.
        admin = lambda route, **body: requests.post(f"{url}/admin/{route}", json=body or None,  # noqa: E731
                                                    headers=AUTH, timeout=120)
        assert requests.post(f"{url}/admin/rollback", timeout=30).status_code == 401
        assert admin("rollback").json() == {"served_step": 30, "system_fingerprint": "gpt_ddp@30"}
        back = complete()
        assert back["system_fingerprint"] == "gpt_ddp@30"
        assert back["choices"][0]["text"] == alone(run_dir / checkpoint_name(30))
        refused = admin("promote", step=50)
        assert refused.status_code == 422 and "not finite" in refused.json()["error"]["message"], refused.text
        assert admin("promote", step=7).status_code == 404
        assert admin("promote", step=40).json()["served_step"] == 40
        assert served(url)["served_step"] == 40

        # The run's own validation loss: a checkpoint worse than the served one's by more than
        # val_loss_tolerance (5%) is refused, a better one is served.
        log = JsonLines(RunStorage(run_dir), METRICS_FILE)
        log.append({"step": 40, "loss": 2.0, "val_loss": 2.0})
        log.append({"step": 60, "loss": 2.2, "val_loss": 2.2})
        commit(run_dir, 60)
        metric(url, "ray_shardyard_weight_swaps_refused_total", "follow_app", lambda n: n >= 2)
        assert served(url)["served_step"] == 40
        log.append({"step": 70, "loss": 1.9, "val_loss": 1.9})
        commit(run_dir, 70)
        wait_for_step(url, 70)
    finally:
        client.stop.set()
        client.join(timeout=120)
        serve.delete("follow_app")
        serve.shutdown()
    assert client.streams and set(client.statuses) == {200}, client.statuses
    steps_seen = set()
    for prints in client.streams:
        steps = [int(p.split("@")[1]) for p in prints]
        assert steps == sorted(steps), prints  # never backwards within a stream
        steps_seen.update(steps)
    assert steps_seen <= {10, 20, 30, 40, 70} and 40 in steps_seen, steps_seen  # never 50 or 60
