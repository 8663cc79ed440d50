"""What the decoding engine runs next: the scheduler decides, the model (the executor) runs, and
the scheduler takes the output (vLLM v1's `schedule()` -> run -> `update_from_output()`). Nothing
here touches a model or a thread, so each decision can be tested alone.

Every iteration first prefills prompt tokens within the token budget: the rest of a prompt
begun earlier, then waiting requests while the batch has room and the KV cache has blocks for
their prompt and max_tokens (prefix blocks already cached are read, not prefilled again). A
prompt longer than what is left of the budget is prefilled in chunks (chunked prefill: at least
`min_chunk` tokens, so nothing starves), one per iteration, each attending over the chunks
before it; its request gets its first token with the last chunk. Then one decode step gives
every running request whose tokens are all in the cache but its newest one its next token.
Where the model's KV cache attends (`cache_attends`), the iteration's chunks and decode step are
one packed pass, so its weights are read once for all of them (vLLM's scheduler mixes them so);
otherwise each chunk and the decode step are passes of their own. A
request that has its tokens, or whose caller stopped waiting, gives its blocks back at the next
decision: a request arriving mid-way waits one iteration, not a whole batch.

The budget is what keeps decoding smooth: prefilling a long prompt at once would stall every
running request's next token for as long as it takes. It starts from a measurement (how long a
prompt token takes to prefill, how long a decode step takes, against the per-token latency
target) and adapts online: halved after an iteration over the target, grown after a full one
well under it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import torch

from shardyard.models.kv_layout import CacheStep
from shardyard.serve.generation import Completion
from shardyard.serve.engine.kv_blocks import BlockPool, block_hashes
from shardyard.serve.sampling import Draw, Outcome

# The fewest prompt tokens a prefill chunk takes: each chunk is a forward pass that reads every weight,
# so prompts up to this long are prefilled whole (benchmarks/serve_vs_vllm.py: chunks of 32 cost 14%
# of the throughput at 128-token prompts) and only longer ones are spread over iterations.
MIN_CHUNK = 128


class LostTwice(RuntimeError):
    """A request caught in a second loss of the shard group (the caller may retry it)."""


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""
    request: Completion
    arrived: float
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # tokens; None when done; an error
    abandoned: bool = False  # its caller stopped waiting: leave at the next decision
    finished: bool = False
    losses: int = 0          # shard groups lost under it
    first_token_at: float | None = None
    table: list[int] = field(default_factory=list)    # its KV cache blocks
    cached: int = 0                                   # of its tokens, those in the cache
    hashes: list[bytes] = field(default_factory=list)  # of its cached full blocks
    lane: int = -1       # its row of the KV cache's lanes while it runs (models/kv_cache.py)
    lane_holds: int = 0  # of its cached tokens, those its lane holds
    weights: str | None = None  # the weights that decode it (set with its first token)

    @property
    def leaving(self) -> bool:
        return self.finished or self.abandoned

    @property
    def tokens(self) -> list[int]:
        """Its prompt and the tokens it has been given: what the cache must hold to go on."""
        return self.request.prompt + self.request.tokens


@dataclass
class Pass:
    """One forward pass for the executor: a prefill chunk of one sequence, one decode token for
    each of several, or (packed: `step.lengths`) both in one row of tokens."""
    seqs: list[Sequence]
    tokens: torch.Tensor  # (rows, new tokens per row); packed: (1, every sequence's new tokens)
    step: CacheStep

    @property
    def counts(self) -> list[int]:
        """Each sequence's new tokens in this pass."""
        return list(self.step.lengths) or [self.tokens.shape[1]] * len(self.seqs)

    def draws(self) -> list[Draw | None]:
        """What the executor needs to pick each row's next token: for a sequence whose tokens
        will all be in the cache after this pass (a prompt's last chunk, a decode step); None
        for a prompt's earlier chunks, and for a sequence leaving anyway."""
        return [s.request.draw() if s.cached + n == len(s.tokens) and not s.leaving else None
                for s, n in zip(self.seqs, self.counts)]


def packed(passes: list[Pass]) -> Pass:
    """Passes as one: each sequence's new tokens after those of the sequences before it, so the
    model reads its weights once for a prompt chunk and the decode steps beside it (as vLLM's
    scheduler mixes them). For a model whose KV cache attends (`cache_attends`)."""
    seqs, tokens, lengths = [], [], []
    for work in passes:
        for row, seq in enumerate(work.seqs):
            seqs.append(seq)
            tokens.append(work.tokens[row])
            lengths.append(work.tokens.shape[1])
    return Pass(seqs, torch.cat(tokens)[None], cache_step(seqs, lengths))


def cache_step(seqs: list[Sequence], lengths: list[int] | None = None) -> CacheStep:
    """What a pass over `seqs` does with the KV cache: each writes after its cached tokens, into
    its blocks and its lane."""
    return CacheStep(tuple(tuple(s.table) for s in seqs), tuple(s.cached for s in seqs), tuple(lengths or ()),
                     lanes=tuple(s.lane for s in seqs), held=tuple(s.lane_holds for s in seqs))


class TokenBudget:
    """Prompt tokens one iteration may prefill: additive increase, multiplicative decrease
    around the per-iteration latency target."""

    def __init__(self, tokens: int, step_target_s: float, increment: int) -> None:
        self.tokens, self.step_target_s, self.increment = max(1, tokens), step_target_s, increment

    def observe(self, iteration_s: float, prefilled: int) -> None:
        if iteration_s > self.step_target_s:
            self.tokens = max(1, self.tokens // 2)
        elif prefilled >= self.tokens and iteration_s < 0.8 * self.step_target_s:
            self.tokens += self.increment


class Scheduler:
    def __init__(self, pool: BlockPool, max_running: int, budget: TokenBudget, min_chunk: int = MIN_CHUNK) -> None:
        self.pool, self.max_running, self.budget, self.min_chunk = pool, max_running, budget, min_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admitting = True  # False while new weights wait for the running requests to finish

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def decoding(self) -> bool:
        """Whether a running request still wants tokens."""
        return any(not s.leaving for s in self.running)

    @property
    def has_work(self) -> bool:
        return any(not s.leaving for s in self.waiting) or self.decoding

    def prefills(self) -> list[Pass]:
        """This iteration's prefill chunks, within the budget: running prompts not yet whole
        first, then waiting requests admitted while there is room."""
        self._release_leaving()
        passes, budget = [], self.budget.tokens
        for seq in self.running:
            if len(seq.tokens) - seq.cached > 1 and budget > 0:
                passes.append(self._chunk(seq, budget))
                budget -= passes[-1].tokens.shape[1]
        while (self.admitting and self.waiting and len(self.running) < self.max_running
               and budget >= min(self.min_chunk, self.budget.tokens)):
            seq = self.waiting[0]
            if seq.abandoned:
                self.waiting.popleft()
                continue
            tokens = seq.tokens
            hashes = block_hashes(tokens, self.pool.block_tokens, [])
            allocated = self.pool.allocate(tokens, hashes, len(seq.request.prompt) + seq.request.max_tokens)
            if allocated is None:
                break  # in line: no request overtakes one that waits for room
            self.waiting.popleft()
            seq.table, seq.cached = allocated
            seq.lane, seq.lane_holds = min(set(range(self.max_running)) - {s.lane for s in self.running}), 0
            seq.hashes = hashes[:seq.cached // self.pool.block_tokens]  # those of the blocks it found
            self.running.append(seq)
            if len(tokens) - seq.cached > 1:  # else all but its newest token was cached: it decodes
                passes.append(self._chunk(seq, budget))
                budget -= passes[-1].tokens.shape[1]
        return passes

    def _chunk(self, seq: Sequence, budget: int) -> Pass:
        """The next chunk of `seq`'s tokens, as much as `budget` leaves and at least `min_chunk`,
        with no last chunk smaller than that."""
        left = len(seq.tokens) - seq.cached
        size = max(budget, self.min_chunk)
        if left - size < self.min_chunk:
            size = left
        chunk = seq.tokens[seq.cached:seq.cached + size]
        return Pass([seq], torch.tensor([chunk], dtype=torch.long), cache_step([seq]))

    def decode(self) -> Pass | None:
        """One token for every running request whose tokens are in the cache but its newest."""
        self._release_leaving()
        # In lane order: rows on consecutive lanes attend over a view of them as they lie.
        seqs = sorted((s for s in self.running if len(s.tokens) - s.cached == 1), key=lambda s: s.lane)
        if not seqs:
            return None
        return Pass(seqs, torch.tensor([[s.tokens[-1]] for s in seqs], dtype=torch.long), cache_step(seqs))

    def iteration(self, packs: bool) -> list[Pass]:
        """This iteration's passes: its prefill chunks, then a decode step; one packed pass when
        the model can run one (`packs`)."""
        passes = self.prefills()
        if (step := self.decode()) is not None:
            passes.append(step)
        return [packed(passes)] if packs and len(passes) > 1 else passes

    def update(self, done: Pass, outcomes: list[Outcome]) -> list[tuple[Sequence, Outcome]]:
        """A pass ran: its tokens are in the cache (their full blocks findable from now on).
        Returns each sequence whose tokens are now all in the cache, with the outcome of its
        draw (a prompt's last chunk, or a decode step), unless it is leaving."""
        ready = []
        for seq, count, outcome in zip(done.seqs, done.counts, outcomes):
            seq.cached += count
            seq.lane_holds = seq.cached
            tokens = seq.tokens
            if seq.cached // self.pool.block_tokens > len(seq.hashes):  # a block filled: hash it, findable
                seq.hashes = block_hashes(tokens[:seq.cached], self.pool.block_tokens, seq.hashes)
                self.pool.register(seq.table, seq.hashes)
            if seq.cached == len(tokens) and not seq.leaving and outcome is not None:
                ready.append((seq, outcome))
        return ready

    def _release_leaving(self) -> None:
        for seq in self.running:
            if seq.leaving:
                self.pool.release(seq.table)
        self.running = [s for s in self.running if not s.leaving]

    def settle(self) -> None:
        """With no work left (has_work false): the requests that finished or were abandoned since
        the last decision leave now, giving their blocks back, instead of at the next request's."""
        self._release_leaving()
        self.waiting = deque(s for s in self.waiting if not s.leaving)

    def start_over(self, failed: Exception | None = None) -> None:
        """The cache's contents are gone (a shard died, the group was replaced) or can no longer
        be trusted (`failed`: an unexpected error mid-step): forget every block, then put every
        running request first in line to be prefilled again from its prompt and the tokens it
        has (its draws depend on its seed and their index only, so it gets the tokens it would
        have got), or fail those caught twice, or all of them with `failed`. Waiting requests are
        untouched."""
        again = []
        for seq in self.running:
            if seq.leaving:
                continue
            seq.losses += 1
            if failed is not None or seq.losses > 1:
                seq.abandoned = True
                seq.out.put_nowait(failed or LostTwice("the model's shards were lost twice under this request"))
            else:
                seq.table, seq.cached, seq.hashes, seq.lane, seq.lane_holds = [], 0, [], -1, 0
                again.append(seq)
        self.running = []
        self.pool.clear()
        self.waiting.extendleft(reversed(again))
