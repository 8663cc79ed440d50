"""A decoding engine per replica: continuous batching (iteration-level scheduling, as in Orca and
vLLM) over a model that keeps a paged KV cache (models/kv_cache.py). The scheduler
(serve/engine/scheduler.py) decides what each iteration runs; the model's `forward` (a LocalModel or a
ShardedModel: the executor) runs it off the event loop (a LocalModel on its own thread) and
picks the ready requests' next tokens where the logits are (each request's Draw goes with the
pass; only token ids come back); this engine hands the scheduler's passes to the executor and
their tokens back, and streams each token to its request's caller.

A shard group lost under an iteration loses its caches: the engine has the group rebuilt and
the scheduler prefills every running request again from its prompt and the tokens it already
has. A request caught in a second loss gets the error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import torch

from shardyard.models.kv_layout import BLOCK_TOKENS, CacheStep
from shardyard.serve.generation import Completion
from shardyard.serve.engine.kv_blocks import BlockPool
from shardyard.serve.sampling import Draw, Outcome
from shardyard.serve.engine.scheduler import MIN_CHUNK, Pass, Scheduler, Sequence, TokenBudget
from shardyard.serve.executor.model_pass import PassTimes

# (token ids, what the pass does with the cache, each row's draw) -> each row's outcome (a pass
# that only resets the caches goes without draws)
CachedForward = Callable[[torch.Tensor, CacheStep, list[Draw | None] | None], list[Outcome]]


# An iteration's time: choosing its passes and taking their outputs (`schedule`); handing each pass
# to the executor's thread and its outputs back (`handoff`: what a pass waited beyond the model's
# own time); the model's forward pass (`forward`, besides `attention` over the KV cache); choosing
# tokens from the logits (`sampling`); giving each request its token (`emit`). With an executor
# that does not time its passes (a shard group), a pass's whole wait is `forward`.
PHASES = ("schedule", "handoff", "forward", "attention", "sampling", "emit")


@dataclass
class EngineStats:
    """What the replica's metrics read: updated by the engine as it runs."""
    iterations: int = 0
    tokens: int = 0
    waiting: int = 0
    running: int = 0
    cache_blocks: int = 0
    cache_blocks_used: int = 0
    prefix_hit_rate: float = 0.0
    prefill_budget: int = 0
    time_to_first_token_s: list[float] = field(default_factory=list)  # drained by the reader
    inter_token_s: list[float] = field(default_factory=list)
    rebuilds: int = 0
    # Where the iterations' time went, seconds summed (PHASES).
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


async def queued_tokens(out: asyncio.Queue, gaps: list[float]) -> AsyncIterator[int]:
    """The tokens put in `out` until None, raising an error put there; the time between each two
    goes to `gaps` (inter-token latency, as the caller sees it)."""
    last = None
    while (item := await out.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        yield item


def check_fits(request: Completion, context: int, blocks: int) -> None:
    """ValueError, saying why, for a request that the model's context or the KV cache cannot hold."""
    total = len(request.prompt) + request.max_tokens
    if total > context:
        raise ValueError(f"the prompt's {len(request.prompt)} tokens plus max_tokens {request.max_tokens} "
                         f"exceed the model's context of {context} tokens")
    if -(-total // BLOCK_TOKENS) > blocks:
        raise ValueError(f"the prompt's {len(request.prompt)} tokens plus max_tokens {request.max_tokens} "
                         f"exceed the KV cache's {blocks * BLOCK_TOKENS} tokens")


class DecodingEngine:
    def __init__(self, forward: CachedForward, max_running: int, context: int, blocks: int, budget: TokenBudget,
                 recover: Callable[[], None], lost: tuple[type[BaseException], ...],
                 min_chunk: int = MIN_CHUNK, prefix_caching: bool = True, weights: str = "",
                 packs: bool = False, executor: Executor | None = None, times: PassTimes | None = None,
                 on_iteration: Callable[[], None] | None = None) -> None:
        """`max_running`: sequences decoded at once; `context`: tokens per sequence; `blocks`: the
        KV cache's blocks (of BLOCK_TOKENS positions). `recover`: rebuild the model's shards
        (blocking) after `forward` raised one of `lost`. `min_chunk`: the fewest prompt tokens a
        prefill chunk takes (fewer only to end a prompt). `weights`: the fingerprint of the
        weights the model holds. `packs`: the model runs packed passes (its KV cache attends), so
        each iteration is one pass. `executor`: where `forward` is called (the model's own thread; by
        default asyncio's executor). `times`: what the executor's passes spent where they ran
        (for the per-step phases; None: an executor that does not say). `on_iteration`: called
        after every iteration, start-over and window, once its outputs are in the requests'
        queues (the engine core sends them on together)."""
        self.forward, self.context, self.recover, self.lost = forward, context, recover, lost
        self.executor, self.times, self.on_iteration = executor, times, on_iteration
        self.packs = packs
        self.pool = BlockPool(blocks, BLOCK_TOKENS, prefix_caching)
        self.scheduler = Scheduler(self.pool, max_running, budget, min_chunk)
        self.stats = EngineStats(cache_blocks=blocks, prefill_budget=budget.tokens)
        self.weights = weights
        self._pause: tuple[asyncio.Future, asyncio.Event] | None = None  # a drained window asked for
        self._wake = asyncio.Event()
        self._loop: asyncio.Task | None = None
        self._outside = 0.0  # the current iteration's time in passes and emits (not scheduling)

    @asynccontextmanager
    async def drained(self) -> AsyncIterator[None]:
        """A window at an iteration boundary: no request is admitted meanwhile and the running
        ones finish on the weights they started with; inside it the caller may swap the model's
        weights and decode with them outside the engine. If `weights` changed meanwhile, every
        cached key and value (prefix-cache blocks too) is dropped before the waiting requests
        start on the new weights."""
        paused, resume = asyncio.get_running_loop().create_future(), asyncio.Event()
        self._pause = (paused, resume)
        self.scheduler.admitting = False
        self._ensure_running()
        try:
            await paused
            yield
        finally:
            resume.set()

    def submit(self, request: Completion) -> Sequence:
        check_fits(request, self.context, self.pool.blocks)
        seq = Sequence(request, request.arrived or time.perf_counter())
        self.scheduler.add(seq)
        self.stats.waiting = len(self.scheduler.waiting)
        self._ensure_running()
        return seq

    def _ensure_running(self) -> None:
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    def tokens(self, seq: Sequence) -> AsyncIterator[int]:
        """`seq`'s tokens as they are decoded; raises what the engine could not recover from."""
        return queued_tokens(seq.out, self.stats.inter_token_s)

    async def _run(self) -> None:
        while True:
            await self._round()
            if self.on_iteration is not None:
                self.on_iteration()

    async def _round(self) -> None:
        """One turn of the loop: a window's pause, a wait for work, or an iteration."""
        if self._pause is not None and not self.scheduler.decoding:
            await self._pause_here()
            return
        if not self.scheduler.has_work:
            # Idle: what finished or was abandoned leaves now, and the numbers say so (a stream
            # abandoned mid-way held its blocks, and counted as running, until the next request).
            self.scheduler.settle()
            self._record_state()
            self._wake.clear()
            await self._wake.wait()
            return
        started = time.perf_counter()
        self._outside = 0.0  # of this iteration, the time its passes and emits took
        try:
            prefilled = 0
            for work in self.scheduler.iteration(self.packs):
                prefilled += sum(n for n in work.counts if n > 1)  # a prompt chunk has two tokens or more
                await self._execute(work)
        except self.lost:
            await self._start_over()
            return
        except Exception as err:  # noqa: BLE001 - a request's error must not stop the loop
            await self._start_over(failed=err)
            return
        elapsed = time.perf_counter() - started
        self.scheduler.budget.observe(elapsed, prefilled)
        self.stats.phases["schedule"] += max(0.0, elapsed - self._outside)
        self.stats.iterations += 1
        self._record_state()

    def _record_state(self) -> None:
        """The requests, blocks and budget as they stand, into the numbers the replica publishes."""
        self.stats.waiting, self.stats.running = len(self.scheduler.waiting), len(self.scheduler.running)
        self.stats.cache_blocks_used, self.stats.prefix_hit_rate = self.pool.used, self.pool.hit_rate
        self.stats.prefill_budget = self.scheduler.budget.tokens

    async def _pause_here(self) -> None:
        """Hold the loop while a `drained` window is open; then, if the weights changed, start
        over with empty caches: only finished requests are left running, and every block is
        forgotten, so none made by the old weights is found again."""
        paused, resume = self._pause
        weights = self.weights
        if not paused.done():
            paused.set_result(None)
        await resume.wait()
        self._pause = None
        self.scheduler.admitting = True
        if self.weights != weights:
            try:
                await self._reset_caches()
            except self.lost:
                await self._start_over()
                return
            self.scheduler.start_over()

    async def _execute(self, work: Pass) -> None:
        """The executor runs one pass and picks; the scheduler takes its output; ready requests
        get their token."""
        outcomes = await self._forward(work.tokens, work.step, work.draws())
        ready = self.scheduler.update(work, outcomes)  # the scheduler's update: `schedule`'s time
        emitting = time.perf_counter()
        for seq, outcome in ready:
            self._emit(seq, outcome)
        emitted = time.perf_counter() - emitting
        self.stats.phases["emit"] += emitted
        self._outside += emitted

    def _emit(self, seq: Sequence, outcome: Outcome) -> None:
        request = seq.request
        if isinstance(outcome, RuntimeError):  # this request's sampling alone: the others in the step go on
            seq.abandoned = True
            seq.out.put_nowait(outcome)
            return
        token = request.accept(outcome)
        self.stats.tokens += 1
        seq.weights = seq.weights or self.weights
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
            self.stats.time_to_first_token_s.append(seq.first_token_at - seq.arrived)
        seq.out.put_nowait(token)
        if request.done:
            seq.finished = True
            seq.out.put_nowait(None)

    async def _start_over(self, failed: Exception | None = None) -> None:
        """Get a working shard group with empty caches, then let the scheduler start over."""
        try:
            await asyncio.to_thread(self.recover)
            await self._reset_caches()
        except self.lost:
            pass  # the next iteration finds out and recovers again
        self.stats.rebuilds += 1
        self.scheduler.start_over(failed)

    async def _reset_caches(self) -> None:
        """Every shard's KV cache emptied (a pass that only resets them)."""
        await self._forward(torch.zeros((1, 1), dtype=torch.long), CacheStep(reset=True), None)

    async def _forward(self, tokens: torch.Tensor, step: CacheStep,
                       draws: list[Draw | None] | None) -> list[Outcome]:
        before = None if self.times is None else replace(self.times)
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, self.forward, tokens, step, draws)
        finally:
            waited = time.perf_counter() - started
            self._outside += waited
            phases = self.stats.phases
            if before is None:
                phases["forward"] += waited
            else:
                model, sampling = self.times.model_s - before.model_s, self.times.sampling_s - before.sampling_s
                attention = self.times.attention_s - before.attention_s
                phases["attention"] += attention
                phases["forward"] += model - attention
                phases["sampling"] += sampling
                phases["handoff"] += max(0.0, waited - model - sampling)
