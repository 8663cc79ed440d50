"""vLLM's own load client, `vllm bench serve`, unmodified, against the app: what people use to
compare LLM servers must complete every request (it sends vLLM's sampling extensions:
`repetition_penalty` always, `ignore_eos` on random prompts), on the completions and the chat
endpoint, for a Hugging Face model directory and for a training run.

vLLM (its CPU build, about 3.5 GB) lives in an environment of its own:
`benchmarks/make_vllm_env.sh` makes it at `.vllm-env` (or where SHARDYARD_VLLM_ENV points).
Without it these tests are skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from shardyard.localdist import free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM_ENV = Path(os.environ.get("SHARDYARD_VLLM_ENV", ROOT / ".vllm-env"))
VLLM = VLLM_ENV / "bin" / "vllm"

pytestmark = pytest.mark.skipif(not VLLM.exists(), reason=f"no vLLM environment at {VLLM_ENV}: make it with "
                                                          f"benchmarks/make_vllm_env.sh")


def model_directory(out: Path) -> Path:
    """A small Llama saved by transformers with a byte-level BPE tokenizer of its own (the bench
    client needs one to make its random prompts)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog; def f(x): return x + 1"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def serving(ray_cluster, tmp_path_factory: pytest.TempPathFactory):
    """Serve on a free port; yields a function that deploys an app and returns its base URL."""
    from ray import serve

    from shardyard.serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    def deploy(name: str, args: dict) -> str:
        serve.run(build_app(args), name=name, route_prefix=f"/{name}")
        return f"http://127.0.0.1:{port}/{name}"

    yield deploy
    serve.shutdown()


def bench(url: str, tokenizer: Path, backend: str, prompt_tokens: int, out: Path) -> dict:
    """`vllm bench serve` on random prompts (`prompt_tokens` in, 16 out), 24 requests, 8 at a time."""
    import requests

    model_id = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    command = [str(VLLM), "bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", endpoint,
               "--model", model_id, "--tokenizer", str(tokenizer), "--dataset-name", "random",
               "--random-input-len", str(prompt_tokens), "--random-output-len", "16", "--num-prompts", "24",
               "--max-concurrency", "8", "--save-result", "--result-dir", str(out), "--result-filename",
               f"{backend}.json", "--ready-check-timeout-sec", "60"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / f"{backend}.json").read_text())


@pytest.fixture(scope="module")
def default_job_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of README's default GPT (UTF-8 bytes as tokens, a 64-token context), as its job writes it."""
    from shardyard.localdist import run_distributed
    from test_serve_run import save_default_job_checkpoint

    run_dir = tmp_path_factory.mktemp("default_job")
    run_distributed(save_default_job_checkpoint, 1, str(run_dir))
    return run_dir


@pytest.mark.timeout(900)
def test_vllms_bench_client_completes_every_request_against_a_model_directory_and_a_run(
        serving, tmp_path: Path, default_job_run: Path) -> None:
    """The run's model reads UTF-8 bytes, not the client's tokens: its prompts are kept short
    (6 of the client's tokens) so that prompt and output fit the 64-byte context."""
    directory = model_directory(tmp_path / "llama")
    apps = {"hf": (serving("hf", {"checkpoint": str(directory), "max_batch_size": 8, "cpus_per_shard": 0.5}), 32),
            "run": (serving("run", {"checkpoint": str(default_job_run), "max_batch_size": 8,
                                    "cpus_per_shard": 0.5}), 6)}
    for name, (url, prompt_tokens) in apps.items():
        for backend in ("openai", "openai-chat"):
            result = bench(url, directory, backend, prompt_tokens, tmp_path / name)
            # Every request completed, each with its 16 tokens (ignore_eos: none ended early).
            assert (result["completed"], result["failed"]) == (24, 0), (name, backend, result.get("errors"))
            assert result["total_output_tokens"] == 24 * 16, (name, backend, result["total_output_tokens"])
