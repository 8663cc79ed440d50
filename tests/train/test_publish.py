"""checkpoint.publish_to: a training run sends its weights to a serving app on the same cluster
through Ray's object store, and the app's shards take their own parts of them however training
split the model. Checked for the two splits people reshard across most and a ZeRO one, each a real run
(`shardyard train` on the session's cluster) and a real app: FSDP over 2 workers into 2 tensor
shards, DDP over 2 workers into 2 pipeline shards, ZeRO-3 over 2 workers into 2 tensor shards.
The run starts before the app exists (its publish of step 4 finds no app, and training goes on),
waits at its checkpoint of step 4 while the app is deployed from it, then publishes step 8,
commits its checkpoint of step 8 and waits there; the app must serve step 8 from the object store
(not from that checkpoint), and the log-probabilities it answers with must be those of the
training model at step 8 (its checkpoint, loaded in this process), token by token.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import requests
import torch

from helpers.fake_cluster import wait_for
from shardyard.checkpoint.loaders import load_model
from shardyard.checkpoint.record import checkpoint_name
from shardyard.localdist import free_port
from shardyard.serve.generation import Completion, decode, encode, generate
from shardyard.train.callbacks import HOLD_ENV, held_at, release
from helpers.repo import REPO, SHARDYARD

PROMPT = "def main():\n    "
TOKENS = 16


def train(ray_cluster, storage: Path, strategy: str, steps: int, *extra: str, hold_at: str = "") -> subprocess.Popen:
    settings = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.block_size=64",
                "data.name=synthetic", "data.num_samples=512", "batch.global_batch_size=8",
                "batch.micro_batch_size=4", "optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0",
                "optim.schedule=constant", f"run.steps={steps}", "run.log_every=4", "checkpoint.every_n_steps=4",
                f"parallelism.strategy={strategy}", "scaling.num_workers=2", f"checkpoint.storage_path={storage}",
                # Half a CPU each: with the app's 1 CPU the run and the app fit a 2-core machine.
                "scaling.resources_per_worker={CPU: 0.5}",
                f"run.name={strategy}", *extra]
    command = [SHARDYARD, "train", str(REPO / "jobs" / "configs" / "gpt_ddp.yaml")]
    for item in settings:
        command += ["--set", item]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address, HOLD_ENV: hold_at}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    output, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, output[-4000:]
    return output


def greedy_logprobs(checkpoint: Path) -> tuple[list[str], list[float]]:
    """The model's greedy tokens after PROMPT (each as the API shows it) and the log-probability
    it gives each."""
    model = load_model(checkpoint).eval()
    tokens = generate(torch.no_grad()(model), [Completion(encode(PROMPT), TOKENS)], model.spec.block_size)[0]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([encode(PROMPT) + tokens]))[0].float(), dim=-1)
    start = len(encode(PROMPT)) - 1
    return [decode([t]) for t in tokens], [logprobs[start + i, t].item() for i, t in enumerate(tokens)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy, sharding", [("fsdp", "tensor"), ("ddp", "pipeline"), ("zero3", "tensor")])
def test_published_weights_serve_resharded_with_the_training_models_logits(ray_cluster, tmp_path: Path,
                                                                           strategy: str, sharding: str) -> None:
    from ray import serve

    from shardyard.serve.app.deployment import build_app

    run_dir = tmp_path / strategy
    app = f"publish_{strategy}"
    proc = train(ray_cluster, tmp_path, strategy, 12, f"checkpoint.publish_to={app}",
                 "checkpoint.publish_every_n_steps=4", hold_at="4,8")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}/{app}"
    models = lambda: requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]  # noqa: E731
    try:
        wait_for(lambda: held_at(run_dir, 4) or proc.poll() is not None, 240, "the run to commit step 4 and wait")
        assert proc.poll() is None, finished(proc)
        serve.run(build_app({"checkpoint": str(run_dir), "engine": {"num_shards": 2, "sharding": sharding,
                                                                    "cpus_per_shard": 0.25},
                             "batching.max_batch_size": 4, "follow.interval_s": 0.5}), name=app, route_prefix=f"/{app}")
        release(run_dir, 4)
        wait_for(lambda: held_at(run_dir, 8), 240, "the run to publish step 8 and wait at its checkpoint")
        wait_for(lambda: models()["served_step"] == 8, 120, "the app to serve step 8")
        assert models()["served_from"] == "object store", models()
        reply = requests.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": 0}).json()
        assert reply["system_fingerprint"] == f"{strategy}@8"
        served = reply["choices"][0]["logprobs"]
        tokens, logprobs = greedy_logprobs(run_dir / checkpoint_name(8))
        assert served["tokens"] == tokens
        assert served["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)
        release(run_dir, 8)
        output = finished(proc)
        assert f"could not publish step 4 to the Serve app '{app}'" in output, output[-3000:]
        assert f"published step 8 to '{app}'" in output and f"published step 12 to '{app}'" in output, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        serve.delete(app)
        serve.shutdown()


@pytest.mark.timeout(120)
def test_many_publishes_keep_the_object_stores_use_bounded(ray_cluster) -> None:
    """Forty versions of 4 MB published to an app's AppWeights (a real actor, holding what the app
    holds): the object store keeps the newest two and frees the others as they are passed over,
    where every version used to stay pinned by the promotion list."""
    import time

    import ray
    from ray.util.state import list_objects

    from shardyard.checkpoint.published import Published
    from shardyard.serve.follow.app_weights import AppWeights
    from shardyard.spec import GPTSpec

    size = 4 << 20
    # The deployment's class as a Ray actor with the deployment's own options (what Serve starts).
    app_weights = ray.remote(**AppWeights.ray_actor_options)(AppWeights.func_or_class).remote()

    def pinned() -> int:
        """Objects of the weights' size the cluster still holds."""
        return sum(1 for o in list_objects(limit=10_000, detail=True, raise_on_missing_output=False)
                   if (o.object_size or 0) >= size)

    try:
        for step in range(1, 41):
            weights = ray.put(torch.zeros(size // 4, dtype=torch.float32).numpy())
            published = Published("soak", step, GPTSpec(), [weights])
            ray.get([app_weights.put.remote(published), app_weights.promote.remote(published)])
            del weights, published
        deadline = time.monotonic() + 60
        while (held := pinned()) > 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert held <= 2, f"{held} published versions still in the object store"
    finally:
        ray.kill(app_weights)
