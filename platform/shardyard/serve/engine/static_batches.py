"""Static batches, for models without a KV cache: requests grouped by Ray Serve's `@serve.batch`
(fixed in size, or adaptive: serve/engine/batching.py), ragged prompts left-padded and masked so that
each answer equals the unbatched one (serve/generation.py), every batch decoded to its end on one
set of weights (a weight swap waits between batches: BatchGate). A shard lost under a batch gets
the shard group rebuilt and the batch resumed where it stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from shardyard.serve.engine.backend import Generation
from shardyard.serve.engine.batching import AdaptiveBatchSize, BatchGate
from shardyard.serve.generation import Completion, decode_steps
from shardyard.serve.executor.protocol import ModelExecutor
from shardyard.serve.engine.metrics import ServingMetrics
from shardyard.serve.executor.shards import SHARD_LOST


@dataclass
class Ticket:
    """One completion waiting in (or running in) a static batch."""
    request: Completion
    arrived: float
    abandoned: bool = False  # its caller stopped waiting (timeout, disconnect)
    weights: str = ""  # the fingerprint of the weights its batch decodes on


class StaticBatches:
    def __init__(self, model: ModelExecutor, block_size: int, metrics: ServingMetrics,
                 weights: Callable[[], str], adaptive: AdaptiveBatchSize | None = None) -> None:
        """`weights`: the fingerprint of the weights the model holds now; `adaptive`: the batch
        size adjusted to the step times observed (None: as set)."""
        self.model, self.block_size, self.metrics = model, block_size, metrics
        self.weights, self.adaptive = weights, adaptive
        self.gate = BatchGate()  # a weight swap runs between batches
        self.limit = 0  # the batch size in force

    def set_batching(self, max_batch_size: int, wait_timeout_s: float) -> None:
        self._decode.set_max_batch_size(max_batch_size)
        self._decode.set_batch_wait_timeout_s(wait_timeout_s)
        self.limit = max_batch_size

    def generate(self, request: Completion) -> Generation:
        ticket = Ticket(request, time.perf_counter())
        return Generation(request, self._decode(ticket), lambda: setattr(ticket, "abandoned", True),
                          lambda: ticket.weights or self.weights())

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _decode(self, tickets: list[Ticket]) -> AsyncIterator[list[Any]]:
        async with self.gate.shared():  # a weight swap waits for this batch to end
            async for tokens in self.decode_batch(tickets):
                yield tokens

    async def decode_batch(self, tickets: list[Ticket]) -> AsyncIterator[list[Any]]:
        """Decode a batch together. After every forward pass, yield for each ticket its new token,
        or StopIteration once it has all of them or nobody waits for it any more."""
        started = time.perf_counter()
        live = [t for t in tickets if not t.abandoned]  # gone before their batch ran: dropped
        self.metrics.batch_started([started - ticket.arrived for ticket in live])
        for ticket in tickets:
            ticket.weights = self.weights()
        requests = [t.request for t in tickets]
        steps = 0
        for attempt in range(2):  # a shard lost mid-batch: rebuild the group and resume, once
            group = self.model.rebuilds
            decoding = decode_steps(self.model.forward, requests, self.block_size, lambda row: tickets[row].abandoned)
            try:
                while (rows := await asyncio.to_thread(next, decoding, None)) is not None:
                    steps += 1
                    self.metrics.tokens.inc(len(rows))
                    got = set(rows)
                    yield [requests[i].tokens[-1] if i in got else StopIteration for i in range(len(tickets))]
                break
            except SHARD_LOST:
                if attempt:
                    raise
                if await asyncio.to_thread(self.model.rebuild, group):
                    self.metrics.rebuilds.inc()
        elapsed = time.perf_counter() - started
        self.metrics.batch_finished(elapsed)
        if self.adaptive and steps and self.adaptive.observe(len(live), elapsed / steps):
            self._decode.set_max_batch_size(self.adaptive.size)
            self.limit = self.adaptive.size
