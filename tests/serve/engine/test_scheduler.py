"""The scheduler's side of decoding, alone: which KV cache blocks hold what (serve/engine/kv_blocks.py)
and what each iteration runs (serve/engine/scheduler.py), driven by hand with made-up logits, no model.
Then prefix caching end to end: requests sharing a prompt prefix read its blocks and still get
exactly the tokens each gets decoded alone. No Ray."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shardyard.serve.generation import Completion, generate
from shardyard.serve.engine.kv_blocks import BlockPool, block_hashes
from shardyard.serve.sampling import Pick, Sampling
from shardyard.serve.engine.scheduler import Scheduler, Sequence, TokenBudget

pytestmark = pytest.mark.timeout(60)

SIZE = 4  # tokens a block, small so that short lists of tokens fill blocks


def allocate(pool: BlockPool, tokens: list[int], total: int) -> tuple[list[int], int] | None:
    return pool.allocate(tokens, block_hashes(tokens, SIZE, []), total)


def test_chained_hashes_tell_equal_prefixes_and_only_them() -> None:
    a = block_hashes(list(range(10)), SIZE, [])
    assert len(a) == 2  # the third block is not full
    assert block_hashes(list(range(8)) + [0, 0, 0, 0], SIZE, [])[:2] == a
    assert block_hashes([9] + list(range(1, 10)), SIZE, [])[1] != a[1]  # same tokens, another prefix
    assert block_hashes(list(range(12)), SIZE, a) == block_hashes(list(range(12)), SIZE, [])  # extended


def test_a_prefix_is_found_shared_kept_while_idle_and_given_up_least_recently_used_first() -> None:
    pool = BlockPool(blocks=6, block_tokens=SIZE)
    first = list(range(9))
    table, cached = allocate(pool, first, total=12)
    assert (len(table), cached) == (3, 0) and pool.used == 3
    pool.register(table, block_hashes(first, SIZE, []))  # its two full blocks written

    # The same 8 tokens then another: the two blocks are read, one new block is written.
    second = first[:8] + [50]
    shared, cached = allocate(pool, second, total=12)
    assert shared[:2] == table[:2] and shared[2] != table[2] and cached == 8
    assert pool.used == 4 and pool.hit_rate == pytest.approx(8 / 18)

    # A whole prompt of cached blocks still computes its last token: one block short.
    again, cached = allocate(pool, first[:8], total=8)
    assert again == table[:1] + [again[1]] and again[1] != table[1] and cached == 4

    pool.release(table)
    pool.release(shared)
    assert pool.used == 2  # the third sequence's
    pool.release(again)
    assert pool.used == 0 and len(pool.idle) == 2  # hashed blocks idle, findable
    found, cached = allocate(pool, second, total=8)
    assert found == table[:2] and cached == 8

    # Room taken from idle blocks when free ones run out: the least recently used first.
    pool.release(found)
    taken, cached = allocate(pool, [70] * 5, total=24)
    assert cached == 0 and len(taken) == 6 and not pool.idle and not pool.by_hash
    assert allocate(pool, [1], total=1) is None  # no room: the caller waits
    pool.release(taken)
    assert pool.used == 0


def test_prefix_caching_off_finds_nothing() -> None:
    pool = BlockPool(blocks=4, block_tokens=SIZE, prefix_caching=False)
    tokens = list(range(9))
    table, _ = allocate(pool, tokens, total=9)
    pool.register(table, block_hashes(tokens, SIZE, []))
    pool.release(table)
    assert allocate(pool, tokens, total=9)[1] == 0 and pool.hit_rate == 0


def sequence(prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(Completion(prompt, max_tokens), 0.0)


def picks_of(token: int, rows: int = 1) -> list[Pick]:
    """What the executor returns for a pass: each row's chosen token."""
    return [Pick(token)] * rows


def test_the_scheduler_chunks_long_prompts_admits_within_room_and_decodes_whole_ones() -> None:
    """A budget of 6 prompt tokens an iteration with chunks of at least 2, 5 blocks of 4 tokens,
    at most 2 running: the decisions, iteration by iteration."""
    pool = BlockPool(blocks=5, block_tokens=SIZE)
    scheduler = Scheduler(pool, max_running=2, budget=TokenBudget(6, 60.0, 0), min_chunk=2)
    long, short, late = sequence(list(range(10)), 3), sequence([7, 8], 2), sequence([9], 1)
    for seq in (long, short, late):
        scheduler.add(seq)

    first = scheduler.prefills()  # the long prompt's first chunk takes the budget: nothing else fits
    assert [(p.seqs, p.tokens.tolist(), p.step.starts) for p in first] == [([long], [list(range(6))], (0,))]
    assert long.table == [0, 1, 2, 3] and scheduler.running == [long]  # room for 13 tokens
    assert first[0].draws() == [None]  # no token before the prompt is whole
    assert scheduler.update(first[0], [None]) == []
    assert scheduler.decode() is None

    second = scheduler.prefills()  # its last 4 tokens (no last chunk under 2), then the short prompt
    assert [(p.seqs, p.tokens.tolist(), p.step.starts) for p in second] == [([long], [[6, 7, 8, 9]], (6,)),
                                                                           ([short], [[7, 8]], (0,))]
    assert len(scheduler.waiting) == 1  # two running: the third waits
    for work in second:
        assert [d is not None for d in work.draws()] == [True]  # each prompt's last chunk asks for a token
        for seq, chosen in scheduler.update(work, picks_of(5)):
            seq.request.accept(chosen)
    assert long.request.tokens == [5] and short.request.tokens == [5]
    step = scheduler.decode()
    assert step.seqs == [long, short] and step.tokens.tolist() == [[5], [5]]
    assert step.step.tables == ((0, 1, 2, 3), (4,)) and step.step.starts == (10, 2)
    assert step.step.lanes == (0, 1) and step.step.held == (10, 2)  # each lane holds its sequence's past

    short.abandoned = True  # its caller left: its block comes back at the next decision
    assert step.draws()[1] is None  # a leaving sequence is not drawn for
    ready = scheduler.update(step, [Pick(6), None])
    assert [seq for seq, _ in ready] == [long]
    long.request.accept(ready[0][1])
    assert scheduler.prefills() == []  # a one-token prompt has nothing to prefill: it decodes
    assert scheduler.running == [long, late] and late.table == [4] and pool.used == 5
    last = scheduler.decode().step
    assert last.starts == (11, 0)
    assert last.lanes == (0, 1) and last.held == (11, 0)  # the late one takes the freed lane, holding nothing yet


def test_a_sequence_waits_in_line_for_blocks_and_start_over_requeues_running_ones_first() -> None:
    pool = BlockPool(blocks=2, block_tokens=SIZE)
    scheduler = Scheduler(pool, max_running=4, budget=TokenBudget(100, 60.0, 0), min_chunk=1)
    big, small = sequence([1, 2, 3], 5), sequence([4], 1)
    queued = sequence([5, 6], 6)
    for seq in (big, small, queued):
        scheduler.add(seq)
    scheduler.prefills()
    assert scheduler.running == [big] and list(scheduler.waiting) == [small, queued]  # 2 blocks for 8 tokens
    scheduler.start_over()
    assert list(scheduler.waiting) == [big, small, queued] and big.losses == 1 and pool.used == 0
    assert (big.lane, big.lane_holds) == (-1, 0)  # the caches are gone: its lane holds nothing
    scheduler.prefills()
    scheduler.start_over()
    assert big.abandoned and isinstance(big.out.get_nowait(), RuntimeError)  # lost twice: its caller is told


@pytest.mark.timeout(120)
def test_requests_sharing_a_prefix_read_its_blocks_and_get_their_tokens_alone() -> None:
    """A 40-token system prompt before each question: the requests after the first find its two
    full 16-token blocks in the cache and prefill only the rest, and every one of them, greedy or
    sampled, gets exactly what it gets decoded alone without a cache. With prefix caching off,
    nothing is found and the tokens are the same."""
    from shardyard.models.gpt import GPT
    from shardyard.spec import GPTSpec
    from helpers.engine import CacheLost, CachedModel
    torch.manual_seed(0)
    model = GPT(GPTSpec(name="gpt", n_layer=2, n_head=4, n_embd=64, block_size=96)).eval()
    with torch.no_grad():  # weights wider than GPT's initial 0.02: the tokens then depend on the whole context
        for weight in model.parameters():
            weight.normal_(0.0, 0.3)
    system = torch.randint(0, 256, (40,)).tolist()

    def requests() -> list[Completion]:
        return [Completion(system + [10 + i, 20 + i], 6, Sampling(temperature=0.9 if i % 2 else 0.0), seed=i)
                for i in range(4)]

    forward = torch.no_grad()(model)
    expected = [generate(forward, [r], model.spec.block_size)[0] for r in requests()]

    async def serve(prefix_caching: bool) -> tuple[list[list[int]], float]:
        from shardyard.serve.engine.decoding import DecodingEngine

        cached = CachedModel(model, rows=4)
        engine = DecodingEngine(cached.forward, 4, 96, cached.blocks, TokenBudget(256, 60.0, 0), cached.recover,
                                (CacheLost,), min_chunk=16, prefix_caching=prefix_caching)
        async def one(request: Completion) -> list[int]:
            return [t async for t in engine.tokens(engine.submit(request))]

        first = [await one(requests()[0])]  # its blocks are in the cache before the rest arrive
        return first + list(await asyncio.gather(*map(one, requests()[1:]))), engine.pool.hit_rate

    got, hit_rate = asyncio.run(asyncio.wait_for(serve(True), 60))
    assert got == expected
    assert hit_rate == pytest.approx(3 * 32 / (4 * 42))  # the later three found 32 of their 42 tokens
    got, hit_rate = asyncio.run(asyncio.wait_for(serve(False), 60))
    assert got == expected and hit_rate == 0
