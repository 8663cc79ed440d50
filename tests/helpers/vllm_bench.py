"""vLLM's load client (`vllm bench serve`) and the Llama directories it loads, shared by the
serving comparison (serve_vs_vllm.py) and tests/serve/engine/test_vllm_client.py.

vLLM (its CPU build) lives in an environment of its own, which benchmarks/make_vllm_env.sh makes at
`.vllm-env` in the checkout (or where SHARDYARD_VLLM_ENV points).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from helpers.repo import REPO

VLLM_ENV = Path(os.environ.get("SHARDYARD_VLLM_ENV", REPO / ".vllm-env"))
VLLM = VLLM_ENV / "bin" / "vllm"


def model_directory(out: Path, hidden: int = 64, layers: int = 2, heads: int = 4, context: int = 128,
                    initializer_range: float = 0.02, vocab_size: int = 320) -> Path:
    """A Llama saved by transformers (random weights, seeded) with a byte-level BPE tokenizer of
    its own: the client needs one to make its random prompts, and vLLM one to serve. `heads` of
    hidden / heads dimensions each, half as many key/value heads. The tokenizer's merges: the
    default 320 tokens from one sentence (quick, for tests); more from the standard library's
    sources, as a real vocabulary (the benchmark's 4,096 and 32,000). Weights drawn wider than
    transformers' default make the likeliest token clearly so (no near ties for two engines'
    rounding to break differently)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_text(vocab_size), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         max_position_embeddings=context, eos_token_id=fast.eos_token_id,
                         initializer_range=initializer_range,
                         bos_token_id=fast.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def training_text(vocab_size: int) -> list[str]:
    """Text to learn `vocab_size` tokens from: one sentence for the smallest vocabulary, else the
    standard library's sources (enough distinct words for tens of thousands of merges)."""
    if vocab_size <= 320:
        return ["the quick brown fox jumps over the lazy dog; def f(x): return x + 1"] * 20
    from shardyard.data.corpus import default_corpus_files

    return [path.read_text(errors="replace") for path in default_corpus_files()]


def bench(url: str, tokenizer: Path, out: Path, *, backend: str = "openai", prompt_tokens: int = 32,
          output_tokens: int = 16, prompts: int = 24, concurrency: int = 8, prefix_tokens: int = 0,
          model_id: str | None = None, api_key: str | None = None) -> dict[str, Any]:
    """`vllm bench serve` on random prompts against the server at `url` (base, without /v1),
    each after the same `prefix_tokens` random tokens, with `api_key` as its bearer token if
    given; its saved result (completed, failed, throughput, TTFT, TPOT, ...)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model_id = model_id or requests.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    name = f"{backend}-{concurrency}-{prefix_tokens}.json"
    command = [str(VLLM), "bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", endpoint,
               "--model", model_id, "--tokenizer", str(tokenizer), "--dataset-name", "random",
               "--random-input-len", str(prompt_tokens), "--random-output-len", str(output_tokens),
               "--random-prefix-len", str(prefix_tokens),
               "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--save-result",
               "--result-dir", str(out), "--result-filename", name, "--ready-check-timeout-sec", "120"]
    key = {"OPENAI_API_KEY": api_key} if api_key else {}  # what the client sends as its bearer token
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **key})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((out / name).read_text())
