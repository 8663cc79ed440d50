"""`engine: vllm`: vLLM's async engine decoding inside the replica, behind shardyard's routes,
guard and text handling. A Hugging Face model directory is decoded as transformers decodes it,
with the guard's answers unchanged; a model vLLM does not load (the own GPT) is served by the
built-in engine instead; vLLM's own load client completes every request.

Needs vLLM importable by the interpreter running the tests: its CPU build's environment
(benchmarks/make_vllm_env.sh) with shardyard installed into it
(`.vllm-env/bin/pip install -e '.[dev]'`), then `.vllm-env/bin/python -m pytest
tests/test_vllm_engine.py`. Elsewhere (the main environment, CI) these tests are skipped, saying so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

pytest.importorskip("vllm", reason="engine: vllm needs vLLM in this interpreter's environment "
                                   "(benchmarks/make_vllm_env.sh, then install shardyard into it)")

from test_vllm_client import bench, default_job_run, model_directory, serving  # noqa: E402,F401 - fixtures

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
TOKEN = "vllm-engine-test-token"


def complete(url: str, body: dict, token: str | None = TOKEN) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(f"{url}/v1/completions", json={"model": "llama", **body}, headers=headers, timeout=120)


def test_vllm_decodes_a_model_directory_as_transformers_does_behind_the_guard(serving, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = model_directory(tmp_path / "llama", hidden=256, layers=2, heads=4, context=256,
                                initializer_range=0.3)  # head_dim 64: what vLLM's CPU attention takes
    (tmp_path / "token").write_text(TOKEN)
    url = serving("vllm", {"checkpoint": str(directory), "engine": "vllm", "model_id": "llama",
                           "bearer_token_file": str(tmp_path / "token"), "max_batch_size": 4, "cpus_per_shard": 1.0})
    assert requests.get(f"{url}/healthz", timeout=30).json()["engine"] == "vllm"

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
    assert complete(url, {"prompt": "the", "max_tokens": 4, "best_of": 3}).status_code == 422
    too_long = complete(url, {"prompt": "the " * 400, "max_tokens": 4})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_a_model_vllm_does_not_load_is_served_by_the_builtin_engine(serving, default_job_run: Path) -> None:
    url = serving("gpt", {"checkpoint": str(default_job_run), "engine": "vllm", "max_batch_size": 4,
                          "cpus_per_shard": 0.5})
    assert requests.get(f"{url}/healthz", timeout=30).json()["engine"] == "builtin"
    answer = requests.post(f"{url}/v1/completions", json={"prompt": "def", "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["text"]) > 0


def test_vllms_bench_client_completes_every_request_against_vllm_behind_shardyard(serving, tmp_path: Path) -> None:
    directory = model_directory(tmp_path / "llama", hidden=256, layers=2, heads=4, context=256)
    url = serving("bench", {"checkpoint": str(directory), "engine": "vllm", "max_batch_size": 8,
                            "cpus_per_shard": 1.0})
    for backend in ("openai", "openai-chat"):
        result = bench(url, directory, tmp_path / backend, backend=backend, prompt_tokens=32)
        assert (result["completed"], result["failed"]) == (24, 0), (backend, result.get("errors"))
        assert result["total_output_tokens"] == 24 * 16
