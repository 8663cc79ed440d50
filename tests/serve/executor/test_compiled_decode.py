"""Compiled decode steps across a weight swap (serve/executor/compiled_decode.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.config
from torch._dynamo.utils import counters

from shardyard.models.gpt import GPT
from shardyard.models.kv_cache import KVCache
from shardyard.models.kv_layout import CacheStep
from shardyard.serve.executor.compiled_decode import CompiledDecode
from shardyard.serve.executor.model_pass import run_model
from shardyard.spec.models import GPTSpec


@pytest.mark.timeout(240)
def test_a_swapped_in_model_gets_graphs_of_its_own_and_its_own_logits() -> None:
    """Three models served in turn by one compiled decode (a weight swap, then another), under a
    recompile limit that the first model's graphs reach: every model's steps still compile (new
    graphs each time, not the compiler's silent eager fallback at its limit) and give that
    model's own logits, never a frozen graph of the weights before."""
    spec = GPTSpec(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64)
    models = []
    for seed in (0, 1, 0):
        torch.manual_seed(seed)
        models.append(GPT(spec).eval())
    cache = KVCache(blocks=8)
    decode = CompiledDecode(cache, 2, spec.block_size, torch.device("cpu"), gemms="")  # untimed: graphs are the point
    prompt, tables = [1, 2, 3, 4], ((0, 1), (2, 3))  # two requests' blocks
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
        for model in models:
            graphs = counters["stats"]["unique_graphs"]
            run_model(model, torch.tensor([prompt] * 2), CacheStep(tables, (0, 0), lanes=(0, 1), held=(0, 0)), cache)
            for rows in (1, 2):  # two shapes: two graphs, the limit
                step = CacheStep(tables[:rows], (4,) * rows, lanes=tuple(range(rows)), held=(4,) * rows)
                logits = decode(model, torch.tensor([[5]] * rows), step)
                expected = model(torch.tensor([prompt + [5]] * rows))[:, -1]
                torch.testing.assert_close(logits[:, -1], expected, rtol=0, atol=1e-5)
            assert counters["stats"]["unique_graphs"] - graphs == 2
    assert decode.failed is None and decode.steps == 6
