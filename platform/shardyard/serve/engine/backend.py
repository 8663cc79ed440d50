"""What the app asks of the engine that decodes for it, whichever it is: the built-in one (a
model in the replica or a shard group: serve/engine/builtin.py) or vLLM (serve/engine/vllm_engine.py).
The routes only generate; the weight gate (serve/follow/gate.py) stages, swaps and judges; neither
asks which engine it holds. As in Ray Serve LLM's `LLMServer` over its engine, or vLLM's API
server over its engine client, the interface is what a caller needs, not how an engine works.

A weight swap is one conversation:

    await engine.stage(source)          # read beside the served weights; WeightsRefused if not finite
    async with engine.drained():        # no request mid-way; staged leftovers freed at the end
        await engine.swap()             # the staged weights serve
        answers = await engine.golden_answers(prompts)
        await engine.swap_back()        # only if they answered wrongly
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from shardyard.checkpoint.published import Published
from shardyard.serve.generation import Completion
from shardyard.serve.engine.golden import GoldenPrompt
from shardyard.serve.engine.metrics import ServingMetrics


class EngineCoreLost(RuntimeError):
    """The engine core's process died under a request (the replica starts another; the caller may
    retry)."""


class WeightsRefused(RuntimeError):
    """Weights the gate keeps from serving: not finite, a validation loss worse than the served
    one's, golden prompts answered wrongly (or not decodable)."""


@dataclass
class Generation:
    """A request being decoded: its tokens as they come, how to tell the engine that nobody waits
    for the rest, and the fingerprint of the weights decoding it."""
    request: Completion
    tokens: AsyncIterator[int]
    abandon: Callable[[], None]
    weights: Callable[[], str]


class EngineBackend(Protocol):
    name: str  # "builtin" or "vllm", as /healthz says
    weights: str  # the fingerprint of the weights serving (set by the gate after a swap)
    bounded: bool  # a request's prompt and max_tokens must fit the model's context (static batches slide)

    def generate(self, request: Completion) -> Generation:
        """Start decoding `request` (its tokens arrive as they are decoded)."""

    async def stage(self, source: str | Published) -> None:
        """Read `source`'s weights beside the served ones; WeightsRefused (nothing kept) if they
        are not finite."""

    def drained(self) -> AbstractAsyncContextManager[None]:
        """A window where no request is mid-way: new ones wait, running ones finish first. At its
        end the weights not serving are let go, and the engine's caches emptied if they changed."""

    async def swap(self) -> None:
        """In the window: the staged weights serve, the served ones wait beside them."""

    async def swap_back(self) -> None:
        """In the window: undo `swap`."""

    async def golden_answers(self, prompts: Sequence[GoldenPrompt]) -> list[str]:
        """In the window: each prompt's greedy answer on the weights serving now; WeightsRefused
        if one cannot be decoded (NaN logits)."""

    async def health(self) -> bool:
        """Whether every part of the engine answers (a shard group being rebuilt does not)."""

    async def heal(self) -> None:
        """Serve's periodic health check: a part found dead is replaced."""

    async def report(self, metrics: ServingMetrics) -> None:
        """Bring `metrics` up to date with what the engine measured."""

    def close(self) -> None:
        """Let go of every process and device the engine holds."""
