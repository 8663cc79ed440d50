"""Serving: sharded models equal the unsharded one, batching equals unbatched decoding, and the
HTTP app (a real Ray Serve deployment on the session cluster) answers every bad input with its
status code, batches concurrent requests, and survives a shard killed under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from shardyard.localdist import free_port, run_distributed
from shardyard.serve.engine.batching import AdaptiveBatchSize, calibrate
from shardyard.serve.sampling import Draw, Pick, Sampling, choose_rows
from shardyard.serve.generation import Completion, decode, decode_steps, encode, generate, sampled_here
from shardyard.checkpoint.layout import read_spec
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.checkpoint.record import step_of
from helpers.oracle import train
from helpers.http import private_file, trickled_bodies
from helpers.serving import STRATEGIES, train_and_save
from helpers.serving import HEADERS, TOKEN, metric

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-block GPT trained 2 steps on 2 ranks by each strategy, as training writes it."""
    out = tmp_path_factory.mktemp("checkpoints")
    run_distributed(train_and_save, 2, str(out))
    return {strategy: out / strategy / "run" / "checkpoint_step_00000002" for strategy in STRATEGIES}


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    from shardyard.serve.generation import left_pad

    return left_pad([encode("def f(x):"), encode("import"), encode("return x + 1 #")])  # <= 16 tokens


@pytest.mark.timeout(300)
# compiled: hops through a Ray compiled graph, as GPU shards pass them (CPU shards use tasks).
@pytest.mark.parametrize("sharding, strategy, num_shards, compiled", [
    ("pipeline", "ddp", 1, False), ("pipeline", "ddp", 2, False), ("pipeline", "ddp", 4, False),
    ("pipeline", "fsdp", 2, True), ("pipeline", "zero2", 2, False), ("tensor", "ddp", 1, False),
    ("tensor", "ddp", 2, False), ("tensor", "ddp", 4, False), ("tensor", "fsdp", 2, False),
    ("tensor", "zero2", 4, False)])
def test_sharded_outputs_equal_unsharded(ray_cluster, checkpoints, sharding: str, strategy: str,
                                         num_shards: int, compiled: bool) -> None:
    import ray

    from shardyard.serve.executor.shards import ShardedModel

    tokens, pad = ragged_batch()
    whole = load_model(checkpoints[strategy]).eval()
    expected = whole(tokens, pad)
    # Half a CPU a shard: 4 shards fit this machine's 2 cores.
    sharded = ShardedModel(str(checkpoints[strategy]), num_shards, sharding=sharding, cpus_per_shard=0.5,
                           compiled=compiled)
    try:
        assert (sharded.graph is not None) == compiled
        parts = ray.get([s.describe.remote() for s in sharded.shards])
        assert len(parts) == num_shards
        if sharding == "pipeline":
            assert [p["blocks"] for p in parts] == sharded.ranges
        full = sum(p.numel() for p in whole.parameters())
        assert all(p["parameters"] < full for p in parts) or num_shards == 1  # each holds only its part
        torch.testing.assert_close(sharded.forward(tokens, pad), expected, rtol=0, atol=1e-5)
        # Given each row's draw, the shards pick: token ids come back, the logits never do.
        draws = [Draw(Sampling()), Draw(Sampling(temperature=0.9, top_k=20, logprobs=3), seed=5, index=2),
                 Draw(Sampling(repetition_penalty=1.3, presence_penalty=0.5), None, 1, prompt=(100, 101), generated=(32,))]
        picks = sharded.forward(tokens, pad, draws)
        assert all(isinstance(p, Pick) for p in picks)
        alone = choose_rows(expected[:, -1].detach(), draws)
        assert [p.token for p in picks] == [p.token for p in alone]
        assert picks[1].logprob == pytest.approx(alone[1].logprob, abs=1e-4)
    finally:
        sharded.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["pipeline", "tensor"])
def test_the_engine_over_sharded_caches_gives_each_request_its_tokens_alone(ray_cluster, checkpoints,
                                                                             sharding: str) -> None:
    """Each pipeline shard caches its own layers, each tensor shard its own heads: the engine over
    two shards gives every request what decoding it alone without a cache gives, even when the
    group is rebuilt mid-way behind its back (as Serve's health check does after a shard died).
    The pipeline's hops go through a compiled graph, as on GPUs: the rebuild tears it down."""
    from shardyard.serve.engine.decoding import DecodingEngine, TokenBudget
    from shardyard.serve.executor.shards import SHARD_LOST, CachesLost, ShardedModel
    from helpers.engine import alone, fresh, serve_all
    model = load_model(checkpoints["ddp"]).eval()
    sharded = ShardedModel(str(checkpoints["ddp"]), 2, sharding=sharding, cache_blocks=3,  # a 16-token block a request
                           cpus_per_shard=0.5, compiled=sharding == "pipeline")
    try:
        engine = DecodingEngine(sharded.forward, 3, model.spec.block_size, 3, TokenBudget(8, 60.0, 4),
                                lambda: sharded.heal(rebuild_if_slow=True), (*SHARD_LOST, CachesLost))
        got = asyncio.run(serve_all(engine, fresh(), join_after=3, midway=sharded.rebuild))
    finally:
        sharded.close()
    assert got == alone(model)
    assert sharded.rebuilds == 1 and engine.stats.rebuilds == 1  # replaced once; the engine prefilled again


def test_batched_generation_equals_one_request_at_a_time_and_resumes_exactly(checkpoints) -> None:
    model = load_model(checkpoints["ddp"]).eval()
    forward = torch.no_grad()(model)

    def fresh() -> list[Completion]:
        return [Completion(encode("def f(x):"), 12), Completion(encode("import"), 20, Sampling(temperature=0.8), seed=3),
                Completion(encode("x" * 30), 8, Sampling(temperature=1.2), seed=7)]  # 30 + 8 tokens: beyond the 16-token window

    together = generate(forward, fresh(), model.spec.block_size)
    alone = [generate(forward, [r], model.spec.block_size)[0] for r in fresh()]
    assert together == alone
    assert [len(t) for t in together] == [12, 20, 8]
    # Decoding cut off after 5 tokens (a lost shard) and started again ends where it would have.
    cut = fresh()
    steps = decode_steps(sampled_here(forward), cut, model.spec.block_size)
    for _ in range(5):
        next(steps)
    steps.close()
    assert [len(r.tokens) for r in cut] == [5, 5, 5]
    assert generate(forward, cut, model.spec.block_size) == together


def test_adaptive_batching_picks_the_fastest_size_within_the_target_and_backs_off(checkpoints) -> None:
    model = load_model(checkpoints["ddp"]).eval()
    measured = calibrate(torch.no_grad()(model), model.spec.block_size, 8)
    assert set(measured.step_s) == {1, 2, 4, 8}
    assert measured.best_size(step_target_s=60.0) == max(measured.step_s, key=measured.tokens_per_s)
    assert measured.best_size(step_target_s=0.0) == 1  # nothing meets it: one request at a time
    aimd = AdaptiveBatchSize(start=4, limit=8, step_target_s=0.1)
    assert aimd.observe(4, 0.05) and aimd.size == 5      # a full batch with headroom: one more
    assert not aimd.observe(2, 0.05) and aimd.size == 5  # not full: no sign a larger one would fill
    assert aimd.observe(5, 0.2) and aimd.size == 2       # over the target: halve
    assert aimd.observe(1, 0.5) and aimd.size == 1 and not aimd.observe(1, 0.5)


# ----------------------------------------------------------------------------- HTTP

@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face Llama (test_models.py's: grouped-query attention) trained 2 steps on 2 ranks."""
    from helpers.models import MODELS
    from helpers.models import job as model_job
    out = tmp_path_factory.mktemp("llama")
    run_distributed(train, 2, model_job(MODELS["llama"], {"strategy": "fsdp"}, 2, out), 2)
    return out / "run" / "checkpoint_step_00000002"


def hf_greedy(model, prompt: str, max_tokens: int) -> str:
    """transformers' own greedy decoding of one prompt, as the served text."""
    ids = torch.tensor([encode(prompt)])
    out = model.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            do_sample=False, pad_token_id=0)
    return decode(out[0, ids.shape[1]:].tolist())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding, num_shards", [("pipeline", 1), ("pipeline", 2), ("tensor", 2)])
def test_a_hugging_face_model_is_served_sharded_and_decodes_as_transformers_does(
        ray_cluster, llama_checkpoint, sharding: str, num_shards: int) -> None:
    """Whole on one shard, or over two split by decoder layers (its `base_model_pp_plan`) or by
    its own tensor-parallel plan, decoded by the engine through the KV cache (each pipeline shard
    caching its layers, each tensor shard its heads' share; 3 requests, 2 at once, so one waits
    for a row): every request gets, token for token, what `generate` gives its prompt alone."""
    from shardyard.serve.engine.decoding import DecodingEngine, TokenBudget
    from shardyard.serve.executor.shards import SHARD_LOST, CachesLost, ShardedModel

    model = load_model(llama_checkpoint).eval()
    # 7 new tokens keep the longest prompt (9) within block_size 16, the context served.
    prompts = ["def", "import os", "x ="]
    sharded = ShardedModel(str(llama_checkpoint), num_shards, sharding=sharding, cache_blocks=2, cpus_per_shard=0.5)

    async def decode_all() -> list[list[int]]:
        engine = DecodingEngine(sharded.forward, 2, sharded.block_size, 2, TokenBudget(8, 60.0, 4), sharded.heal,
                                (*SHARD_LOST, CachesLost))

        async def one(prompt: str) -> list[int]:
            return [t async for t in engine.tokens(engine.submit(Completion(encode(prompt), 7)))]

        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120)

    try:
        answers = asyncio.run(decode_all())
    finally:
        sharded.close()
    assert [decode(a) for a in answers] == [hf_greedy(model, p, 7) for p in prompts]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_a_hugging_face_model_directory_is_served_as_it_is(ray_cluster, tmp_path: Path, architecture: str) -> None:
    """A directory saved by transformers, never trained here: its own weights, split by its
    tensor-parallel plan over two shards, decode as transformers decodes them. (Mixtral's files
    keep each expert's projections apart, which transformers packs as it loads; its experts are
    split into slices of every expert.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardyard.serve.executor.shards import ShardedModel
    from shardyard.serve.resolved import load_config
    from helpers.models import LLAMA, MIXTRAL
    torch.manual_seed(5)
    config = {"llama": LLAMA, "mixtral": MIXTRAL}[architecture]
    keys = {k: v for k, v in config.items() if k != "architecture"}
    directory = tmp_path / architecture
    AutoModelForCausalLM.from_config(AutoConfig.for_model(architecture, **keys)).save_pretrained(directory)
    assert load_config({"checkpoint": str(directory), "engine": {"sharding": "tensor", "num_shards": 2}}, use_gpu=False)
    model = load_model(directory).eval()
    sharded = ShardedModel(str(directory), 2, sharding="tensor", cpus_per_shard=0.5)
    try:
        assert sharded.block_size == LLAMA["max_position_embeddings"]  # the model's whole window
        tokens = torch.randint(0, LLAMA["vocab_size"], (2, 12))
        with torch.no_grad():  # greedy tokens alone hardly see the small experts' share at random init
            torch.testing.assert_close(sharded.forward(tokens), model(tokens), rtol=0, atol=1e-5)
        answers = generate(sharded.forward, [Completion(encode(p), 10) for p in ("def", "import os")],
                           sharded.block_size)
    finally:
        sharded.close()
    assert [decode(a) for a in answers] == [hf_greedy(model, p, 10) for p in ("def", "import os")]


def server_args(checkpoints: dict[str, Path], request_timeout_s: float = 2.0) -> dict:
    token_file = checkpoints["ddp"].parents[2] / "token"  # the token is never a deployment argument
    private_file(token_file, TOKEN + "\n")
    return {"checkpoint": str(checkpoints["ddp"]), "engine": {"num_shards": 2, "cpus_per_shard": 0.25},
            "batching": {"mode": "fixed", "max_batch_size": 8, "batch_wait_timeout_s": 0.05},
            "limits": {"max_queued_requests": 16, "request_timeout_s": request_timeout_s, "max_body_bytes": 2048,
                       "max_tokens_limit": 2048, "body_timeout_s": 120},
            "auth": {"bearer_token_file": str(token_file)}}


@pytest.fixture(scope="module")
def server(ray_cluster, checkpoints):
    """The app on a free port: 2 pipeline shards, small limits so every limit can be reached."""
    from ray import serve

    from shardyard.serve.app.deployment import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(server_args(checkpoints)), name="test_app", route_prefix="/t")
    yield f"http://127.0.0.1:{port}/t"
    serve.shutdown()  # the next module runs `serve run`, which starts Serve its own way


def complete(url: str, **body) -> requests.Response:
    """POST /v1/completions, greedy unless the body says otherwise (OpenAI's default is 1.0)."""
    return requests.post(f"{url}/v1/completions", json={"temperature": 0, **body}, headers=HEADERS, timeout=60)


def text_of(answer: requests.Response) -> str:
    return answer.json()["choices"][0]["text"]


def error_of(answer: requests.Response) -> str:
    return answer.json()["error"]["message"]




@pytest.mark.timeout(240)
def test_concurrent_requests_are_batched_and_each_gets_its_answer(server, checkpoints) -> None:
    model = load_model(checkpoints["ddp"]).eval()
    prompts = [f"line {i}: " + "x" * (i % 5) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: complete(server, prompt=p, max_tokens=6), prompts))
    for prompt, answer in zip(prompts, answers):
        assert answer.status_code == 200, answer.text
        alone = generate(torch.no_grad()(model), [Completion(encode(prompt), 6)], model.spec.block_size)[0]
        assert text_of(answer) == decode(alone)
    # Batches of more than one request: fewer batches than requests (Serve's metrics API, as
    # exported for the whole cluster).
    batches = metric(server, "ray_shardyard_batch_size_count", "test_app")
    assert 0 < batches < len(prompts), "no batch held more than one request"
    # The exact total beside the histogram (whose exported `_sum` Ray estimates from its buckets).
    metric(server, "ray_shardyard_batched_requests_total", "test_app", until=lambda v: v >= len(prompts))


@pytest.mark.timeout(120)
def test_a_streamed_completion_sends_its_text_as_decoded_and_equals_the_whole_answer(server) -> None:
    whole = text_of(complete(server, prompt="stream me", max_tokens=8))
    body = {"prompt": "stream me", "max_tokens": 8, "stream": True, "temperature": 0}
    with requests.post(f"{server}/v1/completions", json=body, headers=HEADERS, stream=True, timeout=60) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        lines = [line.removeprefix("data: ") for line in answer.iter_lines(decode_unicode=True)
                 if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert len(chunks) > 2 and all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


@pytest.mark.timeout(240)
def test_every_bad_input_gets_its_status_and_the_server_keeps_serving(server) -> None:
    url = f"{server}/v1/completions"
    bad_json = requests.post(url, data="{not json", headers={**HEADERS, "Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in error_of(bad_json)
    assert requests.post(url, json={"prompt": "hi"}).status_code == 401
    near = requests.post(url, json={"prompt": "hi"}, headers={"Authorization": f"Bearer {TOKEN[:-1]}"})
    assert near.status_code == 401  # compared whole (in constant time), not by prefix
    too_big = requests.post(url, data=json.dumps({"prompt": "x" * 5000}), headers=HEADERS)
    assert too_big.status_code == 413 and "limit is 2048" in error_of(too_big)
    chunked = requests.post(url, data=iter([b'{"prompt": "', b"x" * 3000, b'"}']), headers=HEADERS)
    assert chunked.status_code == 413 and "over 2048 bytes" in error_of(chunked)  # no Content-Length
    for body, field in [({"prompt": "hi", "max_tokens": 0}, "max_tokens"), ({"prompt": ""}, "prompt"),
                        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
                        ({"prompt": "hi", "max_tokenz": 3}, "max_tokenz"), ({}, "prompt"),
                        ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
                        ({"prompt": "hi", "seed": 2**70}, "seed"), ({"prompt": "hi", "seed": -1}, "seed"),
                        ({"prompt": "hi", "n": 9}, "n"), ({"prompt": "hi", "echo": True}, "echo"),
                        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
                        ({"prompt": "hi", "top_k": -2}, "top_k"), ({"prompt": "hi", "best_of": 2}, "best_of"),
                        ({"prompt": "hi", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
                        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
                        ({"prompt": ["a"] * 9}, "prompt"),  # more choices than a request may carry
                        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
                        ({"prompt": "hi", "top_p": 0}, "top_p")]:
        answer = requests.post(url, json=body, headers=HEADERS, timeout=60)
        assert answer.status_code == 400 and field in error_of(answer), (body, answer.text)
        assert answer.json()["error"]["param"] == field and answer.json()["error"]["type"] == "invalid_request_error"
    wrong = requests.post(f"{server}/v1/predict", json={"inputs": [[1.0]]}, headers=HEADERS)
    assert wrong.status_code == 404 and "/v1/completions" in error_of(wrong)
    not_finite = requests.post(f"{server}/v1/predict", data='{"inputs": [[NaN, Infinity]]}',
                               headers={**HEADERS, "Content-Type": "application/json"})
    assert not_finite.status_code == 400 and "inputs" in error_of(not_finite), not_finite.text
    # Latency is labelled by route, never by the raw path: random paths add no series.
    no_route = requests.get(f"{server}/no/such/path-x7q", headers=HEADERS)
    assert no_route.status_code == 404 and "no route GET" in error_of(no_route)  # the one error shape
    metric(server, "ray_serve_num_http_requests_total", "test_app", lambda n: n >= 10)
    assert "path-x7q" not in requests.get(f"{server}/metrics", headers=HEADERS, timeout=30).text
    # 2048 tokens through 2 shards take far longer than the 2 s request timeout.
    slow = complete(server, prompt="a", max_tokens=2048)
    assert slow.status_code == 408 and "2.0 s" in error_of(slow)
    # Overload: beyond the ongoing and queued limits Serve answers 503 with Retry-After at once.
    # (Three times what the app admits, so that even a slow client machine overflows it.)
    with ThreadPoolExecutor(96) as pool:
        flood = list(pool.map(lambda _: complete(server, prompt="b", max_tokens=2048), range(96)))
    rejected = [r for r in flood if r.status_code == 503]
    assert rejected and all("Retry-After" in r.headers for r in rejected), sorted(r.status_code for r in flood)
    assert {r.status_code for r in flood} <= {408, 503}
    assert complete(server, prompt="still there?", max_tokens=3).status_code == 200
    assert requests.get(f"{server}/healthz").json()["status"] == "ok"


@pytest.mark.timeout(180)
def test_bodies_trickled_over_many_connections_hold_no_slot_an_ordinary_request_needs(server) -> None:
    """200 connections send a completion's head and one byte of its body, then nothing, through
    Serve's proxy (`shardyard serve`'s HAProxy: test_serve_command). The app's engine takes 16
    choices and queues 16 more; Serve counts a request from its first byte, so the trickled bodies
    once filled its slots and an ordinary request got 503 at once. Now the replica holds all 200
    as bodies still arriving and answers the ordinary request meanwhile."""
    with trickled_bodies(server, "/v1/completions", TOKEN, 200):
        metric(server, "ray_shardyard_pending_bodies", "test_app", lambda n: n >= 200)
        answer = complete(server, prompt="still served?", max_tokens=3)
        assert answer.status_code == 200, answer.text


@pytest.mark.timeout(300)
def test_killed_shard_under_load_is_rebuilt_and_later_requests_succeed(ray_cluster, server) -> None:
    from ray.util.state import list_actors

    shard = next(a for a in list_actors(address=ray_cluster.gcs_address,
                                        filters=[("class_name", "=", "PipelineShard"), ("state", "=", "ALIVE")]))
    with ThreadPoolExecutor(8) as pool:
        during = [pool.submit(complete, server, prompt=f"load {i}", max_tokens=20) for i in range(24)]
        time.sleep(0.3)
        os.kill(shard["pid"], signal.SIGKILL)
        codes = [f.result().status_code for f in during]  # every request answered, none hangs
    # Never a 500: one rebuild at a time, and no forward pass on a half-built group. (408: the
    # fixture's 2 s request timeout is shorter than a rebuild.)
    assert set(codes) <= {200, 408, 503}, codes
    deadline = time.monotonic() + 60
    while complete(server, prompt="after", max_tokens=4).status_code != 200:
        assert time.monotonic() < deadline, "requests never succeeded again"
        time.sleep(1)
    metric(server, "ray_shardyard_shard_group_rebuilds_total", "test_app", lambda n: n >= 1)


@pytest.fixture(scope="module")
def default_job_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """README's default GPT (a 64-token context: room for a chat template), as its job saves it."""
    from helpers.serving import save_default_job_checkpoint
    run_dir = tmp_path_factory.mktemp("default_job")
    run_distributed(save_default_job_checkpoint, 1, str(run_dir))
    return find_latest(run_dir)


@pytest.fixture(scope="module")
def engine_server(server, default_job_checkpoint):
    """The default decoder, the engine (KV cache, continuous batching), beside the static app on
    the module's Serve instance: 2 pipeline shards of 0.25 CPU (both apps, 1 CPU each, fit 2 cores)."""
    from ray import serve

    from shardyard.serve.app.deployment import build_app

    serve.run(build_app({"checkpoint": str(default_job_checkpoint), "engine": {"num_shards": 2, "cpus_per_shard": 0.25},
                         "batching.max_batch_size": 4, "model_id": "tiny-gpt", "limits.request_timeout_s": 60}),
              name="engine_app", route_prefix="/e")
    yield server.removesuffix("/t") + "/e"
    serve.delete("engine_app")


@pytest.mark.timeout(240)
def test_the_openai_client_completes_chats_and_streams_against_the_engine(engine_server, server,
                                                                         default_job_checkpoint) -> None:
    from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI

    model = load_model(default_job_checkpoint).eval()
    client = OpenAI(base_url=f"{engine_server}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny-gpt"]

    def alone(prompt: str, max_tokens: int) -> str:
        return decode(generate(torch.no_grad()(model), [Completion(encode(prompt), max_tokens)], 64)[0])

    whole = client.completions.create(model="tiny-gpt", prompt="def f(", max_tokens=8, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == alone("def f(", 8)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (6, 8)
    several = client.completions.create(model="tiny-gpt", prompt=["ab", "import"], max_tokens=5, temperature=0)
    assert [c.text for c in several.choices] == [alone("ab", 5), alone("import", 5)]
    streamed = list(client.completions.create(model="tiny-gpt", prompt="def f(", max_tokens=8, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    # Every answer and every chunk says which weights made it: <run>@<step>; so do /v1/models and /metrics.
    step = step_of(default_job_checkpoint.name)
    fingerprint = f"{read_spec(default_job_checkpoint).run.name}@{step}"
    assert whole.system_fingerprint == fingerprint and {c.system_fingerprint for c in streamed} == {fingerprint}
    listed = requests.get(f"{engine_server}/v1/models", timeout=30).json()["data"][0]
    assert (listed["served_step"], listed["system_fingerprint"]) == (step, fingerprint)
    metric(engine_server, "ray_shardyard_served_step", "engine_app", lambda n: n == step)
    # Each app's /metrics holds its own series alone, though one export holds both apps'.
    theirs = {url: requests.get(f"{url}/metrics", headers=HEADERS, timeout=30).text for url in (engine_server, server)}
    assert 'application="engine_app"' in theirs[engine_server] and 'application="test_app"' not in theirs[engine_server]
    assert 'application="test_app"' in theirs[server] and 'application="engine_app"' not in theirs[server]
    refused = requests.post(f"{engine_server}/admin/rollback", timeout=30)  # an app without an operator's token
    assert refused.status_code == 403 and "admin routes are off" in refused.json()["error"]["message"]
    # A stop string ends the text before it, with finish_reason "stop", streamed or not.
    text = whole.choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model="tiny-gpt", prompt="def f(", max_tokens=8, temperature=0, stop=[stop])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (text[:text.index(stop)], "stop")
    pieces = client.completions.create(model="tiny-gpt", prompt="def f(", max_tokens=8, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == cut.choices[0].text
    # Chat: the plain template (the byte-level model has no chat template), streamed too.
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=4, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == alone("system: be brief\nuser: hi\nassistant:", 4)
    chunks = list(client.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=4, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    # Mistakes come back as the client's typed errors, with the server's reason.
    with pytest.raises(NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(BadRequestError, match="context of 64 tokens") as err:
        client.completions.create(model="tiny-gpt", prompt="x" * 60, max_tokens=8)
    assert err.value.code == "context_length_exceeded"

    async def concurrently() -> list[str]:  # more requests than the engine decodes at once (4): they queue
        aclient = AsyncOpenAI(base_url=f"{engine_server}/v1", api_key="none")
        answers = await asyncio.gather(*(aclient.completions.create(model="tiny-gpt", prompt=f"n{i}", max_tokens=6,
                                                                    temperature=0) for i in range(10)))
        return [a.choices[0].text for a in answers]

    assert asyncio.run(concurrently()) == [alone(f"n{i}", 6) for i in range(10)]
    metric(engine_server, "ray_shardyard_time_to_first_token_seconds_count", "engine_app", lambda n: n >= 10)
    metric(engine_server, "ray_shardyard_kv_cache_blocks", "engine_app", lambda n: n == 16)  # 4 x 64 tokens


@pytest.mark.timeout(240)
def test_vllms_sampling_extensions_logprobs_and_several_choices_are_honoured(engine_server,
                                                                           default_job_checkpoint) -> None:
    """What load tools and vLLM's clients send, against the engine: each choice gets exactly the
    tokens its sampling gives it decoded alone (choice j of a seeded request drawing from seed + j),
    log-probabilities are the model's, streams carry several choices, and what the server cannot
    honour is refused by name."""
    from openai import BadRequestError, OpenAI

    forward = torch.no_grad()(load_model(default_job_checkpoint).eval())
    client = OpenAI(base_url=f"{engine_server}/v1", api_key="none")

    def alone(prompt: str, max_tokens: int, sampling: Sampling = Sampling(), seed: int | None = None) -> str:
        request = Completion(encode(prompt), max_tokens, sampling, seed)
        return decode(generate(forward, [request], 64)[0])

    knobs = dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.2)
    extensions = {"top_k": 8, "min_p": 0.05, "repetition_penalty": 1.3, "ignore_eos": True, "min_tokens": 2}
    several = client.completions.create(model="tiny-gpt", prompt=["ab", "def"], n=3, seed=11, max_tokens=6,
                                        extra_body=extensions, **knobs)
    sampling = Sampling(top_k=8, min_p=0.05, repetition_penalty=1.3, min_tokens=2, ignore_eos=True, **knobs)
    expected = [alone(p, 6, sampling, 11 + j) for p in ("ab", "def") for j in range(3)]
    assert [c.text for c in several.choices] == expected and [c.index for c in several.choices] == list(range(6))
    assert len(set(expected[:3])) > 1 and several.usage.completion_tokens == 36
    # Streamed: the same choices, interleaved by index, then the usage.
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model="tiny-gpt", prompt=["ab", "def"], n=3, seed=11, max_tokens=6,
                                           extra_body=extensions, stream=True,
                                           stream_options={"include_usage": True}, **knobs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(6)] == expected and usage.completion_tokens == 36
    # Log-probabilities: the model's own, token by token, with the likeliest alternatives.
    scored = client.completions.create(model="tiny-gpt", prompt="def f(", max_tokens=5, temperature=0, logprobs=2)
    lp = scored.choices[0].logprobs
    assert "".join(lp.tokens) == scored.choices[0].text and lp.text_offset == list(range(5))
    tokens = encode(scored.choices[0].text)
    for i, token in enumerate(tokens):
        raw = torch.log_softmax(forward(torch.tensor([encode("def f(") + tokens[:i]]))[0, -1].float(), -1)
        assert abs(lp.token_logprobs[i] - float(raw[token])) < 1e-4
        assert float(raw[token]) == float(raw.max())  # greedy: the chosen token is the likeliest
        assert len(lp.top_logprobs[i]) <= 3 and max(lp.top_logprobs[i].values()) == lp.token_logprobs[i]
    chat = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    biased = client.completions.create(model="tiny-gpt", prompt="ab", max_tokens=4, temperature=0,
                                       logit_bias={str(ord("z")): 100})
    assert biased.choices[0].text == "zzzz"
    # Bytes that never complete a character: the text is held back to the end, and every token
    # still arrives in a chunk of its own (no text), as clients that time each chunk expect.
    held = list(client.completions.create(model="tiny-gpt", prompt="ab", max_tokens=6, temperature=0, stream=True,
                                          logit_bias={"128": 100},
                                          extra_body={"stream_options": {"continuous_usage_stats": True}}))
    pieces = [(c.choices[0].text, c.usage.completion_tokens) for c in held if c.choices]
    arrived = [n for _, n in pieces[:-1]]  # the tokens so far in each chunk before the last
    assert "".join(text for text, _ in pieces) == "\ufffd" * 6 and all(text == "" for text, _ in pieces[:-1])
    assert len(arrived) > 1 and arrived == sorted(set(arrived)), pieces
    # Refused by name: what the server cannot honour, and more choices than a request may carry.
    for fields, name in [({"echo": True}, "echo"), ({"best_of": 2}, "best_of"), ({"n": 9}, "n"),
                         ({"min_tokens": 5}, "min_tokens")]:
        with pytest.raises(BadRequestError, match=name):
            client.completions.create(model="tiny-gpt", prompt="ab", max_tokens=4, extra_body=fields)


@pytest.mark.timeout(300)
def test_an_engine_core_killed_mid_stream_fails_its_requests_503_and_a_new_one_serves(ray_cluster,
                                                                                     engine_server) -> None:
    from ray.util.state import list_actors

    def cores() -> list[dict]:
        replica = list_actors(address=ray_cluster.gcs_address, filters=[
            ("class_name", "=", "ServeReplica:engine_app:ModelServer"), ("state", "=", "ALIVE")])
        alive = list_actors(address=ray_cluster.gcs_address,
                            filters=[("class_name", "=", "EngineCore"), ("state", "=", "ALIVE")])
        return [a for a in alive if a["placement_group_id"] == replica[0]["placement_group_id"]]

    def new_core(old: dict) -> dict:
        answer = requests.post(f"{engine_server}/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=120)
        assert answer.status_code == 200, answer.text  # waits for the replica's new core, which then answers
        [new] = cores()
        assert new["pid"] != old["pid"]
        return new

    # The core is killed once every stream has its first token. A fast core can have sent all of
    # every stream by then (60 tokens of a tiny model, while the test reads three streams' first
    # lines on a busy machine): then nothing was cut, and it is tried again on the new core.
    core, errors = cores()[0], []
    body = {"prompt": "k", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    for _ in range(4):
        streams = [requests.post(f"{engine_server}/v1/completions", json=body, stream=True, timeout=120)
                   for _ in range(3)]
        lines = [answer.iter_lines() for answer in streams]
        firsts = [next(line for line in each if line) for each in lines]  # every stream has its first token
        os.kill(core["pid"], signal.SIGKILL)
        ends = [[json.loads(line[6:]) for line in each if line and line != b"data: [DONE]"] for each in lines]
        assert all(f.startswith(b"data: ") for f in firsts), firsts
        errors = [end[-1]["error"] for end in ends if "error" in end[-1]]
        assert all(e["type"] == "service_unavailable" and "engine core" in e["message"] for e in errors), errors
        core = new_core(core)
        if errors:
            break
    assert errors, "every stream had ended before its core was stopped, four times"


@pytest.mark.timeout(300)
def test_a_shard_killed_under_the_engine_is_rebuilt_without_a_500(ray_cluster, engine_server) -> None:
    from ray.util.state import list_actors

    # The engine app's shards: those in its replica's placement group (the static app has its own).
    replica = list_actors(address=ray_cluster.gcs_address,
                          filters=[("class_name", "=", "ServeReplica:engine_app:ModelServer"), ("state", "=", "ALIVE")])
    group = replica[0]["placement_group_id"]
    url = f"{engine_server}/v1/completions"

    def ask(i: int) -> tuple[int, str]:
        body = {"prompt": f"k{i}", "max_tokens": 12, "temperature": 0}
        answer = requests.post(url, json=body, timeout=120)
        return answer.status_code, "" if answer.ok else answer.text

    with ThreadPoolExecutor(8) as pool:
        during = [pool.submit(ask, i) for i in range(24)]
        time.sleep(0.3)
        shards = list_actors(address=ray_cluster.gcs_address,
                             filters=[("class_name", "=", "PipelineShard"), ("state", "=", "ALIVE")])
        os.kill(next(a for a in shards if a["placement_group_id"] == group)["pid"], signal.SIGKILL)
        codes = [f.result() for f in during]  # every request answered, none hangs
    assert {code for code, _ in codes} <= {200, 503}, [c for c in codes if c[0] != 200]
    assert ask(99) == (200, "")


def test_serve_config_mistakes_are_named_before_anything_starts(ray_cluster, tmp_path: Path, checkpoints) -> None:
    import ray

    from shardyard.serve.app.deployment import build_app
    from shardyard.serve.config import parse_config
    from shardyard.serve.resolved import load_config
    from shardyard.spec import SpecError

    def read(args: dict) -> object:
        return load_config(args, use_gpu=False)

    trained = str(checkpoints["ddp"])
    with pytest.raises(SpecError, match=r"n_head \(4\) must be divisible by num_shards \(3\)"):
        read({"checkpoint": trained, "engine": {"sharding": "tensor", "num_shards": 3}})
    with pytest.raises(SpecError, match="cannot split 4 blocks into 5 pipeline shards"):
        read({"checkpoint": trained, "engine.num_shards": 5})
    # A placement group no node can hold is refused at once (it would wait forever): a replica's
    # 0.5 CPU and 2 shards of the node's every CPU do not fit; 4 shards of 0.25 do (on 2 cores).
    cpus = max(node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"])  # the largest node's
    with pytest.raises(SpecError, match=rf"asks for {2 * cpus + 0.5:g} CPU \(STRICT_PACK\); its largest node has "
                                        rf"{cpus:g} CPU: lower engine.num_shards or engine.cpus_per_shard"):
        build_app({"checkpoint": trained, "engine": {"num_shards": 2, "cpus_per_shard": cpus}})
    with pytest.raises(SpecError, match="shardyard train jobs/configs/gpt_ddp.yaml"):
        read({"checkpoint": str(tmp_path / "nothing")})
    with pytest.raises(SpecError, match=r"serving reads a local or shared directory, not object storage; .*aws s3 sync"):
        read({"checkpoint": "s3://bucket/runs/gpt_ddp"})
    with pytest.raises(SpecError, match="unknown key 'engine.num_shard'.*did you mean 'num_shards'"):
        parse_config({"engine.num_shard": 2})
    private_file(tmp_path / "empty_token", "\n")
    with pytest.raises(SpecError, match="is empty"):  # refused, not read as "no auth"
        read({"checkpoint": trained, "auth.bearer_token_file": str(tmp_path / "empty_token")})
    with pytest.raises(SpecError, match=r"max_kv_tokens \(8\) is below one context window \(16 tokens\)"):
        read({"checkpoint": trained, "engine.max_kv_tokens": 8})
    assert read({"checkpoint": trained}).batching.mode == "continuous"  # auto: the GPT has a KV cache
    # A run directory is followed (new checkpoints swapped in) by default; a named checkpoint is not.
    assert read({"checkpoint": str(Path(trained).parent)}).following
    assert read({"checkpoint": trained}).following is False
    with pytest.raises(SpecError, match="follow.enabled serves a run directory's new checkpoints"):
        read({"checkpoint": trained, "follow": True})
    assert read({"checkpoint": str(Path(trained).parent), "batching": "fixed"}).following  # between batches
    assert read({"checkpoint": str(Path(trained).parent), "engine": "vllm"}).following  # whichever engine serves
    assert read({"checkpoint": trained, "engine.max_kv_tokens": 40}).cache_blocks == 3  # of 16 tokens
    assert build_app({"checkpoint": trained, "engine": {"num_shards": 4, "cpus_per_shard": 0.25}})


@pytest.mark.timeout(60)
def test_hugging_face_models_get_the_kv_cache_unless_a_window_is_narrower_than_the_context(tmp_path: Path) -> None:
    """The cache keeps every past token, which a sliding window narrower than the served context
    would not read: such a model is served by static batching, and `continuous` is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardyard.serve.resolved import load_config
    from shardyard.spec import SpecError

    def directory(architecture: str, **keys: object) -> str:
        config = AutoConfig.for_model(architecture, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=16, **keys)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / architecture)
        return str(tmp_path / architecture)

    assert load_config({"checkpoint": directory("llama")}, use_gpu=False).batching.mode == "continuous"
    windowed = directory("mistral", sliding_window=4)  # 4 tokens of a 16-token context
    assert load_config({"checkpoint": windowed}, use_gpu=False).batching.mode == "adaptive"
    with pytest.raises(SpecError, match="continuous needs a model the KV cache serves exactly"):
        load_config({"checkpoint": windowed, "batching": "continuous"}, use_gpu=False)


@pytest.mark.timeout(60)
def test_shard_actors_hold_their_whole_bundle_gpu_included() -> None:
    """Without num_gpus Ray hides a bundle's GPU from the actor in it, which then runs on the CPU;
    without num_cpus it asks 1 CPU to be scheduled, which a 0.75 CPU bundle cannot give."""
    from ray.util.placement_group import PlacementGroup

    from shardyard.serve.executor.placement import bundle_actor_options, shard_bundle

    on_gpu = bundle_actor_options(shard_bundle(True, 0.75), PlacementGroup.empty(), 2)
    assert (on_gpu["num_gpus"], on_gpu["num_cpus"]) == (1.0, 0.75)
    assert on_gpu["scheduling_strategy"].placement_group_bundle_index == 2
    on_cpu = bundle_actor_options(shard_bundle(False, 1.0), PlacementGroup.empty(), 0)
    assert (on_cpu["num_gpus"], on_cpu["num_cpus"]) == (0.0, 1.0)


@pytest.mark.timeout(180)
def test_stopping_the_app_drains_requests_in_flight(server, checkpoints) -> None:
    """Runs after the other tests of the GPT's app: it deletes the app. Serve stops the replica
    gracefully, and the requests it is decoding still get their answers."""
    from ray import serve

    from shardyard.serve.app.deployment import build_app

    # The app again with a request timeout far beyond the decoding time: only draining decides
    # the answers, however slow this machine decodes.
    serve.run(build_app(server_args(checkpoints, request_timeout_s=120.0)), name="test_app", route_prefix="/t")
    # A request's text can come late: a piece that ends inside a UTF-8 character is held back (a
    # barely trained byte model can hold back most of its answer). The stop is asked for once the
    # first text of any request has come: that request at least is still being answered.
    decoding = threading.Event()
    admitted, ended = [threading.Event() for _ in range(4)], [threading.Event() for _ in range(4)]

    def streamed(i: int) -> list[str]:
        body = {"prompt": f"drain {i}", "max_tokens": 400, "temperature": 0, "stream": True}
        lines = []
        with requests.post(f"{server}/v1/completions", json=body, headers=HEADERS, stream=True, timeout=120) as answer:
            assert answer.status_code == 200, answer.text
            admitted[i].set()  # the app has it: its stream has begun
            for line in answer.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
                    decoding.set()
        ended[i].set()
        return lines

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(streamed, i) for i in range(4)]
        assert all(event.wait(60) for event in admitted) and decoding.wait(60), "the requests were never decoded"
        in_flight = [not e.is_set() for e in ended]  # being answered as the stop is asked for
        serve.delete("test_app")  # returns once the app is gone: its replica drained first
        answers = [f.result() for f in running]
    for lines in answers:  # each ran to its end: 400 tokens, no error, the stream closed
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "length", lines[-3:]
    assert any(in_flight), "every request had ended before the stop: nothing was drained"


@pytest.mark.timeout(300)
def test_a_hugging_face_model_answers_over_http(server, llama_checkpoint) -> None:
    """The same app over HTTP, on the module's Serve instance once the GPT's app is gone (it
    takes the GPT's CPU beside the engine's app): the completion is transformers' greedy output."""
    from ray import serve

    from shardyard.serve.app.deployment import build_app
    from shardyard.spec import SpecError

    with pytest.raises(SpecError, match="cannot split 2 blocks into 3 pipeline shards"):
        build_app({"checkpoint": str(llama_checkpoint), "engine.num_shards": 3})
    with pytest.raises(SpecError, match=r"num_key_value_heads \(2\) must be divisible by num_shards \(4\)"):
        build_app({"checkpoint": str(llama_checkpoint), "engine": {"num_shards": 4, "sharding": "tensor"}})
    serve.run(build_app({"checkpoint": str(llama_checkpoint), "engine": {"num_shards": 1, "cpus_per_shard": 0.5}}),
              name="llama_app", route_prefix="/llama")
    try:
        url = server.removesuffix("/t") + "/llama"
        answer = complete(url, prompt="def", max_tokens=10)
        assert answer.status_code == 200, answer.text
        assert text_of(answer) == hf_greedy(load_model(llama_checkpoint).eval(), "def", 10)
        wrong = requests.post(f"{url}/v1/predict", json={"inputs": [[1.0]]}, timeout=60)
        assert wrong.status_code == 404 and "/v1/completions" in wrong.text
    finally:
        serve.delete("llama_app")
