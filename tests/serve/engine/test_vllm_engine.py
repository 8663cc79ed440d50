"""`engine: vllm`: vLLM's async engine decoding inside the replica, behind shardyard's routes,
guard and text handling. A Hugging Face model directory is decoded as transformers decodes it,
with the guard's answers unchanged; a model vLLM does not load (the own GPT) is served by the
built-in engine instead; vLLM's own load client completes every request.

Needs vLLM importable by the interpreter running the tests: the environment
benchmarks/make_vllm_env.sh makes (vLLM's CPU build, with shardyard installed into it). The main
suite runs this module under that environment's python (test_vllm_client.py); by hand:
`.vllm-env/bin/python -m pytest tests/serve/engine/test_vllm_engine.py`. Under an interpreter
without vLLM these tests are skipped, saying so.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

pytest.importorskip("vllm", reason="engine: vllm needs vLLM in this interpreter's environment "
                                   "(benchmarks/make_vllm_env.sh makes one with shardyard in it; run pytest with its python)")

from helpers.http import private_file
from helpers.followed_run import PROMPT, alone, commit  # noqa: E402
from shardyard.checkpoint.record import checkpoint_name  # noqa: E402
from helpers.vllm_bench import bench, model_directory

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
TOKEN = "vllm-engine-test-token"


def complete(url: str, body: dict, token: str | None = TOKEN) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(f"{url}/v1/completions", json={"model": "llama", **body}, headers=headers, timeout=120)


def test_vllm_decodes_a_model_directory_as_transformers_does_behind_the_guard(serving, tmp_path: Path) -> None:
    """A Llama directory served by vLLM behind the guard (a bearer token): greedy decodes equal
    transformers', the guard's answers are its own, and vLLM's load client, sending the token,
    completes every request."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = model_directory(tmp_path / "llama", hidden=256, layers=2, heads=4, context=256,
                                initializer_range=0.3)  # head_dim 64: what vLLM's CPU attention takes
    private_file(tmp_path / "token", TOKEN)
    url = serving("vllm", {"checkpoint": str(directory), "engine": {"backend": "vllm", "cpus_per_shard": 1.0},
                           "model_id": "llama", "auth.bearer_token_file": str(tmp_path / "token"),
                           "batching.max_batch_size": 4})
    assert requests.get(f"{url}/healthz", timeout=30).json()["engine"] == "vllm"
    # The replica and vLLM's processes run at the node's priority, not Ray's 15 for workers.
    titles = {"ray::ServeReplica:vllm:ModelServer", "VLLM::EngineCore", "VLLM::Worker"}
    niceness = {(p.info["cmdline"] or [""])[0].split(".")[0]: p.info["nice"]
                for p in psutil.process_iter(["cmdline", "nice"])}
    assert {title: niceness.get(title) for title in titles} == dict.fromkeys(titles, 0)

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    for prompt in ("the quick brown", "def f(x):"):
        ids = torch.tensor([tokenizer.encode(prompt)])
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                  do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        answer = complete(url, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                "logprobs": 2})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["text"] == tokenizer.decode(expected)
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == 8 and all(p <= 0 for p in logprobs["token_logprobs"])
        # Two alternatives a token, keyed by their text (tokens of one text, such as pieces of a
        # character, share a key).
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])

    several = complete(url, {"prompt": "the", "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 5})
    assert several.status_code == 200 and len(several.json()["choices"]) == 3
    assert complete(url, {"prompt": "the", "max_tokens": 4}, token=None).status_code == 401
    assert complete(url, {"prompt": "the", "max_tokens": 4, "best_of": 3}).status_code == 400
    too_long = complete(url, {"prompt": "the " * 400, "max_tokens": 4})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"

    # The chat endpoint (the completions one is asked above, with the token): both reach the engine
    # as the same requests, and each meets vLLM's client against the built-in engine (test_vllm_client.py).
    result = bench(url, directory, tmp_path / "chat", backend="openai-chat", prompt_tokens=32, api_key=TOKEN)
    assert (result["completed"], result["failed"]) == (24, 0), result.get("errors")
    assert result["total_output_tokens"] == 24 * 16


def test_a_model_vllm_does_not_load_is_served_by_the_builtin_engine(serving, default_job_run: Path) -> None:
    url = serving("gpt", {"checkpoint": str(default_job_run), "engine": {"backend": "vllm", "cpus_per_shard": 0.5},
                          "batching.max_batch_size": 4})
    assert requests.get(f"{url}/healthz", timeout=30).json()["engine"] == "builtin"
    answer = requests.post(f"{url}/v1/completions", json={"prompt": "def", "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["text"]) > 0


# README's Llama job made one that vLLM's CPU attention takes (head_dim 64), on one process.
LLAMA_RUN = ("model.config.hidden_size=256", "model.config.num_attention_heads=4",
             "model.config.num_key_value_heads=4", "parallelism.strategy=ddp",
             "parallelism.activation_checkpointing=false")


def commit_llama(run_dir: Path, step: int, **kwargs) -> Path:
    commit(run_dir, step, overrides=LLAMA_RUN, config="llama_fsdp.yaml", **kwargs)
    return run_dir / checkpoint_name(step)


def test_vllm_follows_a_run_through_the_gate(serving, tmp_path: Path) -> None:
    """A run of a Hugging Face model served by vLLM follows the run: a new checkpoint is reloaded
    by vLLM's workers while a client keeps asking (every answer 200, its fingerprint never going
    back) and then answers as its weights decode alone; one answering a golden prompt otherwise
    than it must, and a diverged one, are refused; an operator's rollback serves the first again."""
    run_dir = tmp_path / "llama_fsdp"
    first = alone(commit_llama(run_dir, 10))
    wanted = alone(commit_llama(tmp_path / "elsewhere" / "llama_fsdp", 20))  # step 20's weights, drawn from seed 20
    private_file(tmp_path / "token", TOKEN)
    private_file(tmp_path / "admin_token", "the-operators-own")
    url = serving("follow", {"checkpoint": str(run_dir), "engine": {"backend": "vllm", "cpus_per_shard": 1.0},
                             "auth": {"bearer_token_file": str(tmp_path / "token"),
                                      "admin_token_file": str(tmp_path / "admin_token")},
                             "batching.max_batch_size": 4,
                             "follow": {"interval_s": 0.5,
                                        "golden_prompts": [{"prompt": PROMPT, "max_tokens": 12, "expect": wanted}]}})
    assert requests.get(f"{url}/healthz", timeout=30).json()["engine"] == "vllm"
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def ask() -> tuple[int, str | None, str | None]:
        reply = requests.post(f"{url}/v1/completions", headers=headers, timeout=120,
                              json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        body = reply.json()
        return reply.status_code, body.get("system_fingerprint"), body.get("choices", [{}])[0].get("text")

    def models() -> dict:
        return requests.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]

    def wait_until(done, what: str) -> None:
        deadline = time.monotonic() + 240
        while not done(models()):
            assert time.monotonic() < deadline, f"{what}: {models()}"
            time.sleep(0.3)

    assert ask() == (200, "llama_fsdp@10", first)
    answers, stop = [], threading.Event()
    client = threading.Thread(target=lambda: [answers.append(ask()) for _ in iter(stop.is_set, True)], daemon=True)
    client.start()
    commit_llama(run_dir, 20)
    wait_until(lambda m: m["served_step"] == 20, "step 20 never served")
    time.sleep(2)
    stop.set()
    client.join(timeout=120)
    steps = [int(weights.split("@")[1]) for status, weights, _ in answers if status == 200]
    assert len(steps) == len(answers) and steps == sorted(steps) and steps[-1] == 20, answers
    assert {text for _, weights, text in answers if weights == "llama_fsdp@20"} == {wanted}, answers
    assert {text for _, weights, text in answers if weights == "llama_fsdp@10"} <= {first}, answers

    commit_llama(run_dir, 30)  # finite weights, drawn from seed 30: the golden prompt answered otherwise
    wait_until(lambda m: "30" in m["refused_steps"], "step 30 never refused")
    assert "golden prompt" in models()["refused_steps"]["30"]
    assert ask() == (200, "llama_fsdp@20", wanted)

    back = requests.post(f"{url}/admin/rollback", headers={"Authorization": "Bearer the-operators-own"}, timeout=120)
    assert back.status_code == 200 and back.json()["served_step"] == 10, back.text
    assert ask() == (200, "llama_fsdp@10", first)
    commit_llama(run_dir, 40, fault="nan")  # committed after the rollback: looked at, and refused
    wait_until(lambda m: "40" in m["refused_steps"], "step 40 never refused")
    assert "not finite" in models()["refused_steps"]["40"]
    assert ask() == (200, "llama_fsdp@10", first)
