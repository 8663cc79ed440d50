"""The decoding engine's test bench: a whole model with its KV cache that can lose it on purpose, a
mix of greedy and sampled requests, each decoded alone with no cache (the oracle), and an engine
serving them with requests joining mid-way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from shardyard.checkpoint.loaders import load_model
from shardyard.models.kv_cache import KVCache
from shardyard.models.kv_layout import BLOCK_TOKENS, CacheStep
from shardyard.serve.engine.backend import EngineBackend
from shardyard.serve.engine.decoding import DecodingEngine, TokenBudget
from shardyard.serve.executor.local_model import LocalModel
from shardyard.serve.executor.model_pass import Draws, model_output, run_model
from shardyard.serve.executor.precision import cast_for_serving
from shardyard.serve.generation import Completion, encode, generate
from shardyard.serve.sampling import Sampling

T = TypeVar("T")


class CacheLost(Exception):
    """What a dead shard's forward pass raises, here on purpose."""


class CachedModel:
    """A whole model with its KV cache, as one pipeline shard holds it; can lose its cache.
    `rows`: sequences decoded at once; `blocks`: the cache's (default: a context window a row)."""

    def __init__(self, model: torch.nn.Module, rows: int, fail_at_call: int | None = None,
                 error_at_call: int | None = None, blocks: int | None = None, paged: bool = False) -> None:
        self.model, self.rows, self.fail_at_call, self.error_at_call = model, rows, fail_at_call, error_at_call
        self.blocks = blocks or rows * -(-model.spec.block_size // BLOCK_TOKENS)
        self.paged = paged
        self.cache = KVCache(self.blocks, paged=paged)
        self.calls, self.most_active = 0, 0
        self.steps: list[tuple[int, CacheStep]] = []  # (new tokens per row, step)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, step: CacheStep, draws: Draws = None) -> torch.Tensor:
        self.calls += 1
        self.steps.append((x.shape[1], step))
        if self.calls == self.fail_at_call:
            raise CacheLost
        if self.calls == self.error_at_call:  # after the step began: the cache is half updated
            self.cache.begin(step, x.shape[1], x.device)
            raise ValueError("a bug in a step")
        out = run_model(self.model, x, step, self.cache)
        self.most_active = max(self.most_active, len(step.tables))
        return model_output(out, step, draws)  # as a shard answers: the picks, or the last position's logits

    def recover(self) -> None:
        self.cache = KVCache(self.blocks, paged=self.paged)


def fresh() -> list[Completion]:
    """Greedy, sampled and nucleus-sampled requests; prompt + max_tokens within the 16-token context."""
    return [Completion(encode("def f(x):"), 7), Completion(encode("import"), 10, Sampling(temperature=0.8), seed=3),
            Completion(encode("x = 1"), 9, Sampling(temperature=1.2, top_p=0.9), seed=7), Completion(encode("class"), 11, Sampling(temperature=0.7), seed=11),
            Completion(encode("#"), 4)]


def alone(model: torch.nn.Module) -> list[list[int]]:
    """Each request decoded by itself, recomputing the whole sequence every token (no cache), on
    the model's device."""
    device = next(model.parameters()).device
    forward = torch.no_grad()(lambda tokens, pad: model(tokens.to(device), pad.to(device)))
    return [generate(forward, [r], model.spec.block_size)[0] for r in fresh()]


async def serve_all(engine: DecodingEngine, requests: list[Completion], join_after: int,
                    abandon: int | None = None, midway: Callable[[], None] | None = None) -> list[list[int]]:
    """The first two requests at once; the rest once the first has `join_after` tokens (mid-way
    through its decoding), after `midway` ran (in a thread); request `abandon` is given up after
    its second token."""
    got: list[list[int]] = [[] for _ in requests]
    started = asyncio.Event()

    async def run(i: int) -> None:
        if i >= 2:
            await started.wait()
        seq = engine.submit(requests[i])
        async for token in engine.tokens(seq):
            got[i].append(token)
            if i == 0 and len(got[0]) == join_after:
                if midway is not None:
                    await asyncio.to_thread(midway)
                started.set()
            if i == abandon and len(got[i]) == 2:
                seq.abandoned = True
                break

    await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(len(requests)))), 60)
    return got


def engine_for(model: CachedModel, budget: int = 8, min_chunk: int = 32, increment: int = 4,
               packs: bool = False) -> DecodingEngine:
    """`packs`: each iteration one packed pass (prompt chunks and decode steps in one row)."""
    return DecodingEngine(model.forward, model.rows, model.model.spec.block_size, model.blocks,
                          TokenBudget(budget, step_target_s=60.0, increment=increment), model.recover, (CacheLost,),
                          min_chunk=min_chunk, packs=packs)


def served_compiled(local: LocalModel) -> list[list[int]]:
    """fresh()'s requests served by the engine over `local` (closed after), whose decode steps
    must have run compiled."""
    try:
        engine = DecodingEngine(local.forward, 3, local.block_size, 3, TokenBudget(8, 60.0, 4), lambda: None, (),
                                packs=local.cache_attends, executor=local.executor)
        got = asyncio.run(serve_all(engine, fresh(), join_after=3))
        assert local.decode.failed is None and local.decode.steps > 0
        return got
    finally:
        local.close()


def run_closing(engine: EngineBackend, scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`scenario` run to its end on a new event loop; then the engine let go, whatever happened."""
    try:
        return asyncio.run(scenario())
    finally:
        engine.close()


def decodes_as_without_a_cache(directory: str, dtype: torch.dtype, use_gpu: bool, compile_for: int = 0) -> None:
    """The check above, for `directory` served in `dtype` on the CPU or the GPU (`compile_for`:
    its decode steps compiled, LocalModel's). On a CPU the compiled products are the compiler's own
    C++ kernels ("CPP"), the ones autotuning picks for a model bound by reading its weights: a
    model this small could be given oneDNN's, and those would go untested."""
    local = LocalModel(directory, use_gpu=use_gpu, cache_blocks=5 * 2, dtype=dtype, compile_for=compile_for,
                       gemms="CPP")
    try:
        assert {p.dtype for p in local.model.parameters()} == {dtype}
        reference = cast_for_serving(load_model(directory).eval(), dtype).to(local.device)
        assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(),
                                                     local.model.state_dict().values()))
        engine = DecodingEngine(local.forward, 2, local.block_size, local.cache.blocks, TokenBudget(8, 60.0, 4),
                                lambda: None, (), packs=local.cache_attends, executor=local.executor)
        requests = fresh()
        got = asyncio.run(serve_all(engine, requests, join_after=3))
        assert {t.dtype for t in local.cache.keys.values()} == {dtype}
        assert not compile_for or (local.decode.failed is None and local.decode.steps > 0)
    finally:
        local.close()
    assert [len(tokens) for tokens in got] == [r.max_tokens for r in requests]
    exact = steps = 0
    for request, tokens in zip(requests, got):
        if request.sampling.temperature > 0:
            continue
        for i, token in enumerate(tokens):
            with torch.no_grad():
                logits = reference(torch.tensor([request.prompt + tokens[:i]], device=local.device))[0, -1].float()
            top = float(logits.max())
            assert float(logits[token]) >= top - 0.02 * max(abs(top), 1.0), (i, token, int(logits.argmax()))
            exact += token == int(logits.argmax())
            steps += 1
    assert exact >= 0.8 * steps  # near-ties are the exception
