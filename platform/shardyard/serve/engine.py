"""A decoding engine per replica: continuous batching (iteration-level scheduling, as in Orca and
vLLM) over a model that keeps a KV cache (models/kv_cache.py).

Requests wait in a queue. Every iteration first prefills prompt tokens within the token budget
and while a cache row is free: the rest of a prompt begun earlier, then waiting requests; a
prompt longer than what is left of the budget is prefilled in chunks (chunked prefill: at least
`min_chunk` tokens, so nothing starves), one per iteration, each attending over the chunks before
it, and its request gets its first token with the last chunk. Then the iteration decodes one
token for every running request whose prompt is whole, in one forward pass. A request that has
its tokens, or whose caller stopped waiting (timed out, disconnected, hit a stop string), leaves
at its next iteration and frees its row for the next one waiting: a request arriving mid-way
waits one iteration, not a whole batch.

The budget is what keeps decoding smooth: prefilling a long prompt at once would stall every
running request's next token for as long as it takes. It starts from a measurement (how long a
prompt token takes to prefill, how long a decode step takes, against the per-token latency
target) and adapts online: halved after an iteration over the target, grown after a full one
well under it.

A shard group lost under an iteration loses its caches: the engine has the group rebuilt and
prefills every running request again from its prompt and the tokens it already has (its random
generator carries on, so it gets the tokens it would have got). A request caught in a second loss
gets the error.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from shardyard.models.kv_cache import CacheStep, compact
from shardyard.serve.generation import Completion

# (token ids, what the pass does with the cache) -> logits (B, T, V)
CachedForward = Callable[[torch.Tensor, CacheStep], torch.Tensor]
# The fewest prompt tokens a prefill chunk takes: each chunk is a forward pass that reads every weight,
# so prompts up to this long are prefilled whole (benchmarks/serve_vs_vllm.py: chunks of 32 cost 14%
# of the throughput at 128-token prompts) and only longer ones are spread over iterations.
MIN_CHUNK = 128


class LostTwice(RuntimeError):
    """A request caught in a second loss of the shard group (the caller may retry it)."""


@dataclass
class Sequence:
    """One request inside the engine."""
    request: Completion
    arrived: float
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # tokens; None when done; an error
    abandoned: bool = False  # its caller stopped waiting: leave at the next iteration
    finished: bool = False
    losses: int = 0          # shard groups lost under it
    first_token_at: float | None = None
    cached: int = 0          # tokens of its prompt in the cache (less than all: a partial prefill)

    @property
    def leaving(self) -> bool:
        return self.finished or self.abandoned


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


@dataclass
class EngineStats:
    """What the replica's metrics read: updated by the engine as it runs."""
    iterations: int = 0
    tokens: int = 0
    waiting: int = 0
    running: int = 0
    cache_rows_used: int = 0
    time_to_first_token_s: list[float] = field(default_factory=list)  # drained by the reader
    inter_token_s: list[float] = field(default_factory=list)
    rebuilds: int = 0


class DecodingEngine:
    def __init__(self, forward: CachedForward, rows: int, context: int, budget: TokenBudget,
                 recover: Callable[[], None], lost: tuple[type[BaseException], ...],
                 min_chunk: int = MIN_CHUNK) -> None:
        """`rows`: sequences the cache holds at once; `context`: tokens per sequence.
        `recover`: rebuild the model's shards (blocking) after `forward` raised one of `lost`.
        `min_chunk`: the fewest prompt tokens a prefill chunk takes (fewer only to end a prompt)."""
        self.forward, self.rows, self.context, self.budget = forward, rows, context, budget
        self.recover, self.lost, self.min_chunk = recover, lost, min_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index = cache row
        self.partial: Sequence | None = None  # a prompt part-prefilled: always the last running one
        self.stats = EngineStats()
        self._wake = asyncio.Event()
        self._loop: asyncio.Task | None = None

    def submit(self, request: Completion) -> Sequence:
        if len(request.prompt) + request.max_tokens > self.context:
            raise ValueError(f"the prompt's {len(request.prompt)} tokens plus max_tokens {request.max_tokens} "
                             f"exceed the model's context of {self.context} tokens")
        seq = Sequence(request, time.perf_counter())
        self.waiting.append(seq)
        self.stats.waiting = len(self.waiting)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        return seq

    async def tokens(self, seq: Sequence) -> AsyncIterator[int]:
        """`seq`'s tokens as they are decoded; raises what the engine could not recover from."""
        last = None
        while (item := await seq.out.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            now = time.perf_counter()
            if last is not None:
                self.stats.inter_token_s.append(now - last)
            last = now
            yield item

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while True:
            if not self.waiting and not any(not s.leaving for s in self.running):
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.perf_counter()
            try:
                prefilled = await self._admit()
                await self._decode()
            except self.lost:
                await self._recover()
                continue
            except Exception as err:  # noqa: BLE001 - a request's error must not stop the loop
                await self._recover(failed=err)
                continue
            self.budget.observe(time.perf_counter() - started, prefilled)
            self.stats.iterations += 1
            self.stats.waiting, self.stats.running = len(self.waiting), len(self.running)
            self.stats.cache_rows_used = len(self.running)

    async def _step(self, kind: str, chunk: list[int] | None = None) -> torch.Tensor:
        """One forward pass: a prefill or extend of `chunk`, or a decode step over every running
        request whose prompt is whole. Rows that are leaving are released by the same call, before
        it computes."""
        if self.partial is not None and self.partial.leaving:
            self.partial = None  # abandoned mid-prompt: released like any leaving row
        partial = self.partial is not None
        release = tuple(row for row, seq in enumerate(self.running) if seq.leaving)
        compact(self.running, release, partial)
        tokens = [chunk] if kind != "decode" else [[s.request.tokens[-1]] for s in self.decoding]
        step = CacheStep(kind, rows=len(tokens), release=release, partial=partial)
        logits = await asyncio.to_thread(self.forward, torch.tensor(tokens, dtype=torch.long), step)
        return logits[:, -1, :].float()

    async def _admit(self) -> int:
        """Prefill within the budget: the partial prompt's next chunk, then waiting requests."""
        prefilled = 0
        if self.partial is not None and not self.partial.leaving:
            prefilled += await self._prefill(self.partial, prefilled)
        while self.waiting and (self.partial is None or self.partial.leaving):
            seq = self.waiting[0]
            if seq.abandoned:
                self.waiting.popleft()
                continue
            in_use = sum(1 for s in self.running if not s.leaving)
            if in_use >= self.rows or (prefilled and self.budget.tokens - prefilled < self.min_chunk):
                break
            self.waiting.popleft()
            seq.cached = 0
            prefilled += await self._prefill(seq, prefilled)
        return prefilled

    async def _prefill(self, seq: Sequence, prefilled: int) -> int:
        """The next chunk of `seq`'s prompt (its prompt and any tokens it had before a lost
        cache), as much as the budget leaves; its first token once the prompt is whole."""
        prompt = seq.request.prompt + seq.request.tokens
        size = max(self.budget.tokens - prefilled, self.min_chunk)
        if len(prompt) - seq.cached - size < self.min_chunk:  # no last chunk smaller than min_chunk
            size = len(prompt) - seq.cached
        chunk = prompt[seq.cached:seq.cached + size]
        opening = seq.cached == 0
        try:
            logits = await self._step("prefill" if opening else "extend", chunk)
        finally:  # running even when the step failed under it: recovered with the others, not lost
            if opening:
                self.running.append(seq)
        seq.cached += len(chunk)
        self.partial = seq if seq.cached < len(prompt) else None
        if self.partial is None and not seq.leaving:
            self._emit(seq, logits[0])
        return len(chunk)

    @property
    def decoding(self) -> list[Sequence]:
        """The running requests whose prompts are whole: all but a partial prompt (the last)."""
        return self.running[:len(self.running) - (self.partial is not None)]

    async def _decode(self) -> None:
        if not any(not s.leaving for s in self.decoding):
            return
        logits = await self._step("decode")
        for seq, row in zip(self.decoding, logits):  # as the step compacted them
            if not seq.leaving:  # abandoned while the step ran: its token is not wanted
                self._emit(seq, row)

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> None:
        request = seq.request
        try:
            token = request.advance(logits)
        except RuntimeError as err:  # this request's sampling alone: the others in the step go on
            seq.abandoned = True
            seq.out.put_nowait(err)
            return
        self.stats.tokens += 1
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
            self.stats.time_to_first_token_s.append(seq.first_token_at - seq.arrived)
        seq.out.put_nowait(token)
        if request.done:
            seq.finished = True
            seq.out.put_nowait(None)

    async def _recover(self, failed: Exception | None = None) -> None:
        """The caches are gone (a shard died, the group was replaced) or can no longer be trusted
        (`failed`: an unexpected error mid-step): get a working group with empty caches, then
        prefill every running request again (first in line), or fail those caught twice, or all
        of them with `failed`. Waiting requests are untouched."""
        try:
            await asyncio.to_thread(self.recover)
            await asyncio.to_thread(self.forward, torch.zeros((1, 1), dtype=torch.long), CacheStep("reset"))
        except self.lost:
            pass  # the next iteration finds out and recovers again
        self.stats.rebuilds += 1
        again = []
        for seq in self.running:
            if seq.leaving:
                continue
            seq.losses += 1
            if failed is not None or seq.losses > 1:
                seq.abandoned = True
                seq.out.put_nowait(failed or LostTwice("the model's shards were lost twice under this request"))
            else:
                again.append(seq)
        self.running, self.partial = [], None
        self.waiting.extendleft(reversed(again))
