"""How many requests one decoding batch may hold, and how long a batch waits to fill; and for
the engine, how many prompt tokens one iteration may prefill.

`fixed` takes both from the config. `adaptive` measures, at start-up, how long one decode step
takes at each batch size, picks the size with the most tokens per second whose step time stays
within the per-token latency target, and then keeps adjusting it while serving (additive increase,
multiplicative decrease) as observed step times drift: a busier machine gets smaller batches, an
idle headroom larger ones. The same measurement, taken on each candidate device, picks the device.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch

from shardyard.serve.engine.scheduler import TokenBudget
from shardyard.serve.generation import Forward

# Prompts of this many tokens stand for typical traffic while calibrating.
CALIBRATION_PROMPT = 32
CALIBRATION_REPEATS = 3


def candidate_sizes(limit: int) -> list[int]:
    sizes = [1]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == limit else [*sizes, limit]


@dataclass
class Calibration:
    step_s: dict[int, float]  # batch size -> median seconds of one decode step

    def tokens_per_s(self, size: int) -> float:
        return size / self.step_s[size]

    def best_size(self, step_target_s: float) -> int:
        """The batch size with the most tokens/s whose step meets the target (1 if none does)."""
        fitting = [b for b, s in self.step_s.items() if s <= step_target_s] or [1]
        return max(fitting, key=self.tokens_per_s)

    def wait_timeout_s(self, size: int) -> float:
        """Waiting longer for company than one single-request step takes costs the waiting
        request more than sharing a batch saves it."""
        return self.step_s[1] if size > 1 else 0.0


def median_forward_s(forward: Forward, tokens: torch.Tensor, pad: torch.Tensor | None) -> float:
    """Median seconds of one forward pass over `tokens`, after a warm-up (first calls allocate)."""
    forward(tokens, pad)
    times = []
    for _ in range(CALIBRATION_REPEATS):
        start = time.perf_counter()
        forward(tokens, pad)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate(forward: Forward, block_size: int, limit: int) -> Calibration:
    """Median time of one forward pass over a batch of typical prompts, for each candidate size."""
    width = min(CALIBRATION_PROMPT, block_size)
    return Calibration({size: median_forward_s(forward, torch.randint(0, 256, (size, width)),
                                               torch.zeros(size, dtype=torch.long))
                        for size in candidate_sizes(limit)})


class AdaptiveBatchSize:
    """Additive increase, multiplicative decrease of the maximum batch size on observed steps."""

    def __init__(self, start: int, limit: int, step_target_s: float) -> None:
        self.size, self.limit, self.step_target_s = start, limit, step_target_s

    def observe(self, batch_size: int, step_s: float) -> bool:
        """Feed one batch's mean step time; True if the maximum batch size changed."""
        before = self.size
        if step_s > self.step_target_s:
            self.size = max(1, self.size // 2)
        elif batch_size >= self.size and step_s < 0.8 * self.step_target_s:
            self.size = min(self.limit, self.size + 1)  # full batches with headroom: try one more
        return self.size != before


def prefill_budget(forward: Forward, block_size: int, rows: int, step_target_s: float) -> TokenBudget:
    """The engine's starting budget: the prompt tokens that, prefilled beside a decode step over
    every cache row, keep one iteration within the per-token target (measured, without a cache,
    as one prompt of typical length and one step over `rows` sequences of one token)."""
    width = min(CALIBRATION_PROMPT, block_size)
    per_token = median_forward_s(forward, torch.randint(0, 256, (1, width)), None) / width
    step = median_forward_s(forward, torch.randint(0, 256, (rows, 1)), None)
    return TokenBudget(int((step_target_s - step) / per_token), step_target_s, increment=width)


class BatchGate:
    """Static batches run together (shared); a weight swap runs alone (exclusive), between
    batches: it waits for the running ones to finish, and batches formed meanwhile wait for it,
    so every request of a batch decodes on one set of weights."""

    def __init__(self) -> None:
        self._running = 0
        self._swapping = False
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._swapping)
            self._running += 1
        try:
            yield
        finally:
            async with self._changed:
                self._running -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._swapping)
            self._swapping = True  # from now on no batch starts
            await self._changed.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._swapping = False
                self._changed.notify_all()
