"""The decoding engine (KV cache, continuous batching) against decoding each request alone with no
cache: requests joining and leaving mid-way, more requests than cache rows, abandoned requests,
and a lost cache (a shard group rebuilt) all give every request exactly the tokens it gets alone.
In one process, on a checkpoint training wrote: Ray adds nothing to this math (test_serve.py runs
the engine behind HTTP on sharded models)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardyard.models.kv_cache import KVCache
from shardyard.models.kv_layout import BLOCK_TOKENS, CacheStep
from shardyard.serve.engine.decoding import DecodingEngine, TokenBudget
from shardyard.serve.executor.local_model import LocalModel
from shardyard.serve.generation import Completion, encode
from shardyard.serve.executor.model_pass import run_model
from shardyard.checkpoint.loaders import load_model
from helpers.engine import CachedModel, alone, engine_for, fresh, serve_all, served_compiled


def mixed_packed_passes(model: CachedModel) -> int:
    """How many of the model's passes packed decode steps and a prompt chunk together."""
    return sum(1 for _, step in model.steps if 1 in step.lengths and any(n > 1 for n in step.lengths))


def whole(blocks: int) -> tuple[int, ...]:
    return tuple(range(blocks))


@pytest.mark.timeout(30)
def test_each_row_reads_its_own_blocks_wherever_they_lie() -> None:
    """Two sequences in blocks scattered over the pool (2 positions a block): a decode step
    writes each new token into its row's block for that position and returns each row its own
    past in order, masked past its own length; a chunk of a prompt attends over the chunk before."""
    cache, cpu = KVCache(blocks=6, block_tokens=2), torch.device("cpu")

    def run(tables: tuple[tuple[int, ...], ...], starts: tuple[int, ...], keys: list[list[float]]) -> torch.Tensor:
        new = torch.tensor(keys)[:, None, :, None]  # (rows, 1 head, tokens, 1)
        cache.begin(CacheStep(tables, starts), new.shape[2], cpu)
        return cache.update("0", new, new)[0][:, 0, :, 0]

    assert run(((4, 1),), (0,), [[1.0, 2.0, 3.0]]).tolist() == [[1.0, 2.0, 3.0]]
    assert run(((0,),), (0,), [[7.0, 8.0]]).tolist() == [[7.0, 8.0]]
    got = run(((4, 1), (0, 5)), (3, 2), [[4.0], [9.0]])
    assert got[0].tolist() == [1.0, 2.0, 3.0, 4.0] and got[1, :3].tolist() == [7.0, 8.0, 9.0]
    assert cache.positions(1, cpu).tolist() == [[3], [2]]
    assert cache.attention_mask(1, cpu)[:, 0, 0].tolist() == [[True] * 4, [True, True, True, False]]
    assert cache.keys["0"][[8, 9, 2, 3], 0, 0].tolist() == [1.0, 2.0, 3.0, 4.0]  # blocks 4 then 1
    chunk = run(((0, 5, 2),), (3,), [[10.0, 11.0]])  # the second sequence's next chunk
    assert chunk[0].tolist() == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert cache.attention_mask(2, cpu)[0, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    with pytest.raises(RuntimeError, match="hold 2 positions"):
        cache.begin(CacheStep(((3,),), (1,)), 2, cpu)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cache.begin(CacheStep(((6,),), (0,)), 1, cpu)


def attended_alone(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A row's attention computed alone, its two key heads repeated for four query heads (what
    transformers' eager attention does), its new tokens at the end of its keys."""
    keys, values = keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1)
    causal = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool).tril(keys.shape[2] - q.shape[2])
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal)


@pytest.mark.timeout(30)
def test_grouped_query_attention_over_scattered_blocks_equals_each_row_alone() -> None:
    """Four query heads sharing two key heads, rows of different lengths in scattered blocks: a
    decode step's attention, and a prompt chunk's after a cached one, equal each row's attention
    computed alone with its key heads repeated (what transformers' eager attention does)."""
    torch.manual_seed(0)
    cpu, lengths, tables = torch.device("cpu"), (5, 9, 2), ((7, 1), (2, 6, 4), (0,))

    past = [(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)) for n in lengths]
    cache = KVCache(blocks=8, block_tokens=4)
    for table, (keys, values) in zip(tables, past):
        cache.begin(CacheStep((table,), (0,)), keys.shape[2], cpu)
        cache.attend("0", torch.zeros(1, 4, keys.shape[2], 8), keys, values)
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8)
    cache.begin(CacheStep(tables, lengths), 1, cpu)
    expected = torch.cat([attended_alone(q[r:r + 1], *(torch.cat([p, new[r:r + 1]], 2)
                                                       for p, new in zip(past[r], (k, v)))) for r in range(3)])
    torch.testing.assert_close(cache.attend("0", q, k, v), expected, rtol=0, atol=1e-6)
    # The second row's next two tokens as one chunk, over its 10 cached positions (blocks 2, 6, 4).
    cached = [torch.cat([p, new[1:2]], 2) for p, new in zip(past[1], (k, v))]
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    cache.begin(CacheStep((tables[1],), (10,)), 2, cpu)
    got = cache.attend("0", q, k, v)
    torch.testing.assert_close(got, attended_alone(q, torch.cat([cached[0], k], 2), torch.cat([cached[1], v], 2)),
                               rtol=0, atol=1e-6)


@pytest.mark.timeout(30)
def test_a_lane_that_holds_its_past_is_read_in_place_and_one_that_does_not_is_filled_from_the_blocks() -> None:
    """Three sequences on lanes 4, 0 and 2 (gaps between: the lanes between attend and are
    dropped): a decode step whose lanes hold each past reads them, not the blocks (the blocks
    are overwritten first, and the attention is unchanged); a sequence new to a lane that another
    one held, its prefix found in the blocks, is filled from them and attends as alone."""
    torch.manual_seed(0)
    cpu, lengths, tables, lanes = torch.device("cpu"), (5, 9, 2), ((7, 1), (2, 6, 4), (0,)), (4, 0, 2)

    past = [(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)) for n in lengths]
    cache = KVCache(blocks=8, block_tokens=4)
    for table, lane, (keys, values) in zip(tables, lanes, past):
        cache.begin(CacheStep((table,), (0,), lanes=(lane,), held=(0,)), keys.shape[2], cpu)
        cache.attend("0", torch.zeros(1, 4, keys.shape[2], 8), keys, values)
    for pool in (cache.keys["0"], cache.values["0"]):
        pool.fill_(float("nan"))  # were the blocks read, the attention would be NaN
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8)
    cache.begin(CacheStep(tables, lengths, lanes=lanes, held=lengths), 1, cpu)
    expected = torch.cat([attended_alone(q[r:r + 1], *(torch.cat([p, new[r:r + 1]], 2)
                                                       for p, new in zip(past[r], (k, v)))) for r in range(3)])
    torch.testing.assert_close(cache.attend("0", q, k, v), expected, rtol=0, atol=1e-6)
    # A new sequence on lane 4 (which held the first one) whose first 8 positions are the second
    # one's blocks 2 and 6 (a prefix found cached): they are read into the lane, then its chunk.
    cache.begin(CacheStep(((2, 6, 4),), (0,)), 9, cpu)  # the blocks of the second sequence, NaN no more
    second = [torch.cat([p, new[1:2]], 2) for p, new in zip(past[1], (k, v))]
    cache.attend("0", torch.zeros(1, 4, 9, 8), second[0][:, :, :9], second[1][:, :, :9])
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    cache.begin(CacheStep(((2, 6, 5),), (8,), lanes=(4,), held=(0,)), 3, cpu)
    got = cache.attend("0", q, k, v)
    prefix = [t[:, :, :8] for t in second]
    torch.testing.assert_close(got, attended_alone(q, torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2)),
                               rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="cannot hold"):
        cache.begin(CacheStep(((2, 6, 5),), (8,), lanes=(4,), held=(9,)), 1, cpu)
    with pytest.raises(RuntimeError, match="lane of its own"):
        cache.begin(CacheStep(tables[:2], (5, 9), lanes=(1, 1), held=(0, 0)), 1, cpu)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("paged", [False, True])
def test_a_packed_pass_attends_each_sequence_over_its_own_past_only(paged: bool) -> None:
    """Decode steps, a prompt's later chunk, a fresh prompt and one more decode step packed into
    one row of tokens (four query heads on two key heads, blocks scattered): each sequence's
    attention equals its own computed alone, over its own past and nothing of the others', read
    from its lane or (`paged`) from its blocks where they lie."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")

    cache = KVCache(blocks=12, block_tokens=4, paged=paged)
    tables = ((7, 1), (2, 6, 4), (0, 9), (11, 3), (5, 8))
    cached_lengths, new_lengths = (5, 9, 2, 0, 3), (1, 1, 3, 4, 1)
    past = [(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)) for n in cached_lengths]
    for table, (keys, values) in zip(tables, past):
        if keys.shape[2]:
            cache.begin(CacheStep((table,), (0,)), keys.shape[2], cpu)
            cache.attend("0", torch.zeros(1, 4, keys.shape[2], 8), keys, values)
    total = sum(new_lengths)
    q, k, v = torch.randn(1, 4, total, 8), torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    step = CacheStep(tables, cached_lengths, new_lengths)
    cache.begin(step, total, cpu)
    assert cache.positions(total, cpu).tolist() == [[5, 9, 2, 3, 4, 0, 1, 2, 3, 3]]
    assert step.ends(total) == [0, 1, 4, 8, 9]
    got, at = cache.attend("0", q, k, v), 0
    for (keys, values), n in zip(past, new_lengths):
        span = slice(at, at + n)
        expected = attended_alone(q[:, :, span], torch.cat([keys, k[:, :, span]], 2),
                                  torch.cat([values, v[:, :, span]], 2))
        torch.testing.assert_close(got[:, :, span], expected, rtol=0, atol=1e-6)
        at += n
    with pytest.raises(RuntimeError, match="attended by the cache"):
        cache.update("0", k, v)  # a model attending itself cannot take a packed pass
    with pytest.raises(RuntimeError, match="do not cover"):
        cache.begin(CacheStep(tables[:2], (5, 9), (1, 2)), 4, cpu)


@pytest.mark.timeout(120)
def test_paged_attention_reads_a_shared_prefix_block_for_both_sequences() -> None:
    """Two sequences whose first block is one (a cached prefix): under paged attention each
    attends over that block and its own, as if alone; a block named at two different places of
    two tables (which no prefix can be) is refused."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    cache = KVCache(blocks=6, block_tokens=4, paged=True)
    prefix, first, second = ((torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)) for n in (4, 2, 3))
    cache.begin(CacheStep(((3, 5),), (0,)), 6, cpu)
    cache.attend("0", torch.zeros(1, 4, 6, 8), *(torch.cat(pair, 2) for pair in zip(prefix, first)))
    cache.begin(CacheStep(((3, 1),), (4,)), 3, cpu)
    cache.attend("0", torch.zeros(1, 4, 3, 8), *second)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    cache.begin(CacheStep(((3, 5), (3, 1)), (6, 7)), 1, cpu)
    got = cache.attend("0", q, k, v)
    for row, own in enumerate((first, second)):
        keys, values = (torch.cat([prefix[i], own[i], (k, v)[i][row:row + 1]], 2) for i in (0, 1))
        torch.testing.assert_close(got[row:row + 1], attended_alone(q[row:row + 1], keys, values), rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"block 3 is at two indices of the step's tables: \[0, 1\]"):
        cache.begin(CacheStep(((3, 5), (1, 3)), (6, 7)), 1, cpu)


@pytest.mark.timeout(60)
def test_an_idle_engine_has_let_go_of_what_finished_and_what_was_abandoned(ddp_checkpoint: Path) -> None:
    """Requests that finished or were abandoned leave as the engine goes idle, not when the next
    request comes: once nothing decodes, the numbers the replica publishes (requests running,
    cache blocks held) read zero. An abandoned stream used to count as running, holding its blocks,
    until another request arrived."""
    engine = engine_for(CachedModel(load_model(ddp_checkpoint).eval(), 2))
    finished, abandoned = fresh()[:2]

    async def serve_then_idle() -> None:
        async for _ in engine.tokens(engine.submit(finished)):
            pass
        seq = engine.submit(abandoned)
        async for _ in engine.tokens(seq):
            seq.abandoned = True  # its client left after one token
            break
        for _ in range(500):  # the loop's next turn finds no work
            if engine.stats.running == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(serve_then_idle())
    assert (engine.stats.running, engine.stats.waiting, engine.stats.cache_blocks_used) == (0, 0, 0)
    assert engine.pool.used == 0 and not engine.scheduler.has_work


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rows", [2, 8])
@pytest.mark.parametrize("packs", [False, True])
def test_the_engine_gives_each_request_its_tokens_alone(ddp_checkpoint: Path, rows: int, packs: bool) -> None:
    model = load_model(ddp_checkpoint).eval()
    expected = alone(model)
    cached = CachedModel(model, rows)
    got = asyncio.run(serve_all(engine_for(cached, packs=packs), fresh(), join_after=3, abandon=3))
    assert got[3] == expected[3][:2]  # abandoned after two tokens: its row went to others
    del got[3], expected[3]
    assert got == expected
    assert cached.most_active <= rows  # more requests than rows: the rest waited their turn
    if rows == 2:
        assert cached.most_active == 2
    assert (mixed_packed_passes(cached) > 0) == packs


@pytest.mark.timeout(120)
def test_compiled_decode_steps_give_each_request_its_tokens_alone(ddp_checkpoint: Path) -> None:
    """The one-shard model with its decode steps compiled (serve/executor/compiled_decode.py: padded to a
    power-of-two row count over a fixed cache): greedy and seeded requests joining and leaving get
    exactly their tokens decoded alone without a cache, and decode steps did run compiled (the
    iterations that also prefill run eagerly); the graphs were compiled as the model started, so no
    request waited for the compiler."""
    from torch._dynamo.utils import counters

    local = LocalModel(str(ddp_checkpoint), cache_blocks=3, compile_for=3, gemms="")  # oneDNN's, untimed
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    assert served_compiled(local) == alone(load_model(ddp_checkpoint).eval())
    assert counters["stats"]["unique_graphs"] == graphs


@torch.library.custom_op("shardyard_tests::without_fake_kernel", mutates_args=())
def without_fake_kernel(x: torch.Tensor) -> torch.Tensor:
    """An operator PyTorch's compiler cannot trace (it has no fake kernel), the identity eagerly."""
    return x.clone()


@pytest.mark.timeout(120)
def test_a_decode_step_that_fails_to_compile_runs_eagerly_and_says_so_once(ddp_checkpoint: Path, capsys) -> None:
    """A model with an operator the compiler cannot trace: the first compiled step fails, is said
    once, and that step and every later one run eagerly, with the same logits."""
    from shardyard.serve.executor.compiled_decode import CompiledDecode

    model = load_model(ddp_checkpoint).eval()
    model.lm_head.register_forward_hook(lambda module, args, out: without_fake_kernel(out))
    cache = KVCache(blocks=2)
    decode = CompiledDecode(cache, 1, model.spec.block_size, torch.device("cpu"))
    prompt = torch.tensor([encode("def f(x)")])
    with torch.no_grad():
        run_model(model, prompt, CacheStep((whole(2),), (0,), lanes=(0,), held=(0,)), cache)
        for position in (8, 9):
            step = CacheStep((whole(2),), (position,), lanes=(0,), held=(position,))
            assert decode(model, torch.tensor([[5]]), step) is None
            logits = run_model(model, torch.tensor([[5]]), step, cache)
            expected = model(torch.cat([prompt, torch.tensor([[5] * (position - 7)])], 1))[:, -1]
            torch.testing.assert_close(logits[:, -1], expected, rtol=0, atol=1e-5)
    assert capsys.readouterr().out.count("compiling the decode step failed") == 1
    assert decode.failed and decode.steps == 0


@pytest.mark.timeout(120)
def test_a_model_decoded_in_the_replicas_process_gives_each_request_its_tokens_alone(ddp_checkpoint: Path) -> None:
    """One shard's worth of model served in the calling process (serve/executor/local_model.py, what a
    one-shard app uses): a run directory resolves to its newest checkpoint, held while served;
    its cached steps send only the last position's logits; the engine over it is exact, and hands
    every pass straight to the model's own thread (no thread of asyncio's in between)."""
    from shardyard.checkpoint.reader_holds import live_holds
    from shardyard.storage.store import RunStorage
    from shardyard.serve.executor.local_model import LocalModel

    storage = RunStorage(str(ddp_checkpoint.parent))

    model = load_model(ddp_checkpoint).eval()
    local = LocalModel(str(ddp_checkpoint.parent), cache_blocks=3)  # the run directory: a 16-token block a request
    try:
        assert local.checkpoint_dir == str(ddp_checkpoint) and live_holds(storage, ddp_checkpoint.name)
        prompt = torch.tensor([encode("def f(x)")])
        logits = local.forward(prompt, CacheStep((whole(1),), (0,)))
        assert logits.shape == (1, 1, model.spec.vocab_size)
        with torch.no_grad():
            torch.testing.assert_close(logits[0, -1], model(prompt)[0, -1], rtol=0, atol=1e-5)
        called_on: set[int] = set()

        def forward(*args: object) -> object:
            called_on.add(threading.get_ident())
            return local.forward(*args)

        engine = DecodingEngine(forward, 3, local.block_size, 3, TokenBudget(8, 60.0, 4), lambda: None, (),
                                executor=local.executor)
        got = asyncio.run(serve_all(engine, fresh(), join_after=3))
        assert got == alone(model)
        assert called_on == {local.thread.run(threading.get_ident)}
    finally:
        local.close()
    assert not live_holds(storage, ddp_checkpoint.name)  # closed: training may prune it again


@pytest.mark.timeout(120)
def test_each_iterations_time_is_told_by_phase(ddp_checkpoint: Path) -> None:
    """The engine's per-step figures: the model's, attention's and sampling's seconds are what the
    executor measured of the engine's passes (nothing counted twice or lost), the hand-off is what
    a pass waited beyond them, and the phases together are within the time the engine ran."""
    import time

    from shardyard.serve.engine.decoding import PHASES
    from shardyard.serve.executor.local_model import LocalModel

    local = LocalModel(str(ddp_checkpoint), cache_blocks=3)
    try:
        engine = DecodingEngine(local.forward, 3, local.block_size, 3, TokenBudget(8, 60.0, 4), lambda: None, (),
                                packs=local.cache_attends, executor=local.executor, times=local.times)
        started = time.perf_counter()
        requests = fresh()
        requests[0].arrived = started - 10.0  # it waited 10 s at the replica before the engine took it
        asyncio.run(serve_all(engine, requests, join_after=3))
        elapsed = time.perf_counter() - started
    finally:
        local.close()
    # Time to first token counts from the request's arrival at the replica, when it says.
    ttft = sorted(engine.stats.time_to_first_token_s)
    assert len(ttft) == len(requests) and ttft[-1] >= 10.0 > ttft[-2], ttft
    phases, times = engine.stats.phases, local.times
    assert set(phases) == set(PHASES) and times.passes >= engine.stats.iterations > 0
    assert all(phases[p] > 0 for p in PHASES), phases  # the GPT's cache attends: attention is timed
    assert phases["forward"] + phases["attention"] == pytest.approx(times.model_s, rel=1e-9)
    assert (phases["attention"], phases["sampling"]) == pytest.approx((times.attention_s, times.sampling_s), rel=1e-9)
    assert phases["attention"] < times.model_s and sum(phases.values()) < elapsed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("architecture", ["gpt", "llama"])
@pytest.mark.parametrize("packs", [False, True])
def test_prompts_prefilled_in_chunks_between_decode_steps_decode_exactly(ddp_checkpoint: Path,
                                                                         architecture: str, packs: bool) -> None:
    """A budget of 3 prompt tokens an iteration: every prompt longer than that is prefilled in
    chunks of at least 2 (each attending over those before it), with other requests decoding in
    between (packed: in the same pass) and one abandoned mid-way; every request still gets its
    tokens alone."""
    if architecture == "gpt":
        model = load_model(ddp_checkpoint).eval()
    else:
        from shardyard.models import build_model
        from shardyard.spec import HFSpec
        from helpers.models import MODELS
        torch.manual_seed(0)
        spec = MODELS["llama"]
        model = build_model(HFSpec(**{**spec, "config": {**spec["config"], "initializer_range": 0.5}})).eval()
    expected = alone(model)
    cached = CachedModel(model, rows=3)
    got = asyncio.run(serve_all(engine_for(cached, budget=3, min_chunk=2, increment=0, packs=packs), fresh(),
                                join_after=3, abandon=2))
    assert got[2] == expected[2][:2]
    del got[2], expected[2]
    assert got == expected
    chunks = [(start, n) for width, step in cached.steps
              for start, n in zip(step.starts, step.lengths or (width,) * len(step.starts)) if n > 1]
    assert any(start > 0 for start, _ in chunks)  # a prompt's later chunk, over the first
    assert (mixed_packed_passes(cached) > 0) == packs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("architecture", ["gpt", "llama attending itself"])
def test_paged_attention_decodes_every_request_exactly(ddp_checkpoint: Path, architecture: str) -> None:
    """Attention reading the blocks in place (no lanes): the GPT with prompts prefilled in chunks
    packed with decode steps, and a Llama whose own (eager) attention gets each row's past read
    out of its blocks (`update`), give every request the tokens it gets alone."""
    if architecture == "gpt":
        model = load_model(ddp_checkpoint).eval()
    else:
        from shardyard.models import build_model
        from shardyard.spec import HFSpec
        from helpers.models import MODELS
        torch.manual_seed(0)
        spec = MODELS["llama"]
        config = {**spec["config"], "initializer_range": 0.5, "attn_implementation": "eager"}
        model = build_model(HFSpec(**{**spec, "config": config})).eval()
        assert not model.cache_attends
    expected = alone(model)
    cached = CachedModel(model, rows=3, paged=True)
    packs = model.cache_attends
    got = asyncio.run(serve_all(engine_for(cached, budget=3, min_chunk=2, increment=0, packs=packs), fresh(),
                                join_after=3))
    assert got == expected
    assert not cached.cache.lane_keys and (mixed_packed_passes(cached) > 0) == packs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fail_at_call", [1, 9])
def test_a_lost_cache_is_prefilled_again_and_decoding_goes_on_exactly(ddp_checkpoint: Path, fail_at_call: int) -> None:
    """Lost under the first prefill (the request being prefilled is neither running nor waiting
    then: it must not be dropped) or mid-way, with requests running."""
    model = load_model(ddp_checkpoint).eval()
    expected = alone(model)
    cached = CachedModel(model, rows=4, fail_at_call=fail_at_call)
    engine = engine_for(cached)
    got = asyncio.run(serve_all(engine, fresh(), join_after=2))
    assert got == expected
    assert engine.stats.rebuilds == 1


@pytest.mark.timeout(120)
def test_an_unexpected_error_fails_the_running_requests_and_the_engine_goes_on(ddp_checkpoint: Path) -> None:
    """A step that raises something unforeseen leaves the caches untrustworthy: the requests
    running then get the error, the caches start over, and every later request is exact."""
    model = load_model(ddp_checkpoint).eval()
    expected = alone(model)
    cached = CachedModel(model, rows=2, error_at_call=4)

    async def scenario() -> tuple[list[BaseException | list[int]], list[list[int]]]:
        engine = engine_for(cached)

        async def collect(request: Completion) -> BaseException | list[int]:
            try:
                return [t async for t in engine.tokens(engine.submit(request))]
            except ValueError as err:
                return err

        first = await asyncio.gather(*(collect(r) for r in fresh()[:2]))
        later = await asyncio.gather(*(collect(r) for r in fresh()))
        return first, later

    first, later = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert all(isinstance(f, ValueError) for f in first), first
    assert later == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("packs", [False, True])
def test_a_hugging_face_model_decodes_through_the_engines_cache_exactly(architecture: str, packs: bool) -> None:
    """transformers' attention layers write through the engine's cache (`EngineCache`): a Llama
    (rotary positions, grouped-query attention) and GPT-2 (learned positions) give every request,
    joining and leaving mid-way, what it gets decoded alone without a cache; greedy requests get
    what transformers' own `generate` gives (up to its stop at the end-of-sequence token)."""
    from shardyard.models import build_model
    from shardyard.spec import HFSpec
    from helpers.models import MODELS
    torch.manual_seed(0)
    # Weights drawn wider than transformers' default (0.02): attention then depends clearly on
    # positions and content, so a wrong position or mask changes the tokens.
    spec = MODELS[architecture]
    model = build_model(HFSpec(**{**spec, "config": {**spec["config"], "initializer_range": 0.5}})).eval()
    expected = alone(model)
    assert model.cache_attends  # sdpa asked for: the cache's own attention
    cached = CachedModel(model, rows=2)
    got = asyncio.run(serve_all(engine_for(cached, packs=packs), fresh(), join_after=3))
    assert got == expected
    assert (mixed_packed_passes(cached) > 0) == packs
    for request, tokens in zip(fresh(), got):
        if request.sampling.temperature == 0:
            ids = torch.tensor([request.prompt])
            out = model.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=request.max_tokens, pad_token_id=0)[0, ids.shape[1]:].tolist()
            assert out and tokens[:len(out)] == out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("architecture", ["gpt", "llama"])
@pytest.mark.parametrize("packs", [False, True])
def test_a_cached_pass_computes_the_head_for_each_sequences_last_token_only(architecture: str, packs: bool) -> None:
    """The engine reads one next token's logits per sequence: a pass of two prompts (rows of 9
    tokens, or packed with a decode step in one row) puts only those positions through the head
    (its input has one row per sequence), and the logits it returns are each sequence's last
    position's, equal to the model's own output there without a cache."""
    from shardyard.models import build_model
    from shardyard.models.gpt import GPT
    from shardyard.spec import GPTSpec, HFSpec
    from helpers.models import MODELS
    torch.manual_seed(0)
    if architecture == "gpt":
        model = GPT(GPTSpec(name="gpt", n_layer=2, n_head=4, n_embd=32, block_size=16)).eval()
        head = model.lm_head
    else:
        model = build_model(HFSpec(**MODELS["llama"])).eval()
        head = model.hf.lm_head
    seen: list[int] = []  # positions each call of the head computes
    head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[:-1].numel()))
    cache, first, second = KVCache(4), torch.randint(0, 256, (1, 9)), torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        expected = torch.stack([model(first)[0, -1], model(second)[0, -1]])
        if packs:  # the first prompt's 8 tokens are cached; its 9th decodes beside the second prompt
            run_model(model, first[:, :8], CacheStep(((0,),), (0,)), cache)
            tokens, step = torch.cat([first[:, 8:], second], 1), CacheStep(((0,), (2,)), (8, 0), (1, 9))
        else:
            tokens, step = torch.cat([first, second]), CacheStep(((0,), (2,)), (0, 0))
        seen.clear()
        logits = run_model(model, tokens, step, cache)
    assert seen == [2]
    assert logits.shape == (2, 1, 256)
    torch.testing.assert_close(logits[:, 0], expected, rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
def test_a_decode_step_computes_the_same_early_and_late_in_the_context() -> None:
    """With the cache a step computes one token; without it, the whole sequence. Counted in
    floating-point operations (torch's FlopCounterMode), not timed: in a model with a 1024-token
    context the cached step at position 1000 does exactly the matrix work of the step at
    position 10, while recomputing the sequence does over 100x more. (Attention over the cached
    past, the linear term a cache cannot remove, is not in the count: the counter does not see
    the CPU kernel of scaled_dot_product_attention. benchmarks/serve_engine.py times it.)"""
    from torch.utils.flop_counter import FlopCounterMode

    from shardyard.models.gpt import GPT
    from shardyard.spec import GPTSpec

    torch.manual_seed(0)
    model = GPT(GPTSpec(name="gpt", n_layer=2, n_head=4, n_embd=64, block_size=1024)).eval()

    def flops(run: Callable[[], object]) -> dict[str, int]:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            run()
        return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}

    def cached_step(context: int) -> dict[str, int]:
        cache = KVCache(1024 // BLOCK_TOKENS)
        with torch.no_grad():
            run_model(model, torch.randint(0, 256, (1, context)), CacheStep((whole(cache.blocks),), (0,)), cache)
        return flops(lambda: run_model(model, torch.randint(0, 256, (1, 1)), CacheStep((whole(cache.blocks),),
                                                                                          (context,)), cache))

    early, late = cached_step(10), cached_step(1000)
    assert early and early == late, (early, late)
    recompute = flops(lambda: model(torch.randint(0, 256, (1, 1000))))
    assert sum(recompute.values()) > 100 * sum(late.values())
