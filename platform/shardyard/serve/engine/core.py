"""The engine core: continuous batching in a process of its own, as in vLLM v1. The replica keeps
HTTP, auth, tokenizing, detokenizing and streaming (serve/engine/core_client.py); this actor,
which the replica starts and owns (Ray ends it with its owner), runs the scheduler and the model's
step loop back to back on its own event loop, takes new requests and cancellations between steps,
and hands back every step's tokens, for all requests, in one message.

The model is the built-in engine's (serve/engine/builtin.py): in this process, or a shard group
driven from it. Weight swaps reach it through the same actor: stage, a drained window, swap, the
golden answers, swap back, the new fingerprint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace

from shardyard.checkpoint.layout import serving_spec
from shardyard.checkpoint.published import Published
from shardyard.serve.engine.builtin import BuiltinEngine
from shardyard.serve.engine.decoding import EngineStats
from shardyard.serve.engine.golden import GoldenPrompt
from shardyard.serve.engine.scheduler import LostTwice, Sequence as EngineSequence
from shardyard.serve.generation import Completion
from shardyard.serve.resolved import ResolvedConfig
from shardyard.serve.sampling import Pick


@dataclass
class Update:
    """What one request got in a step: its tokens (with their log-probabilities where asked for),
    and whether it ended, finished or failed."""
    picks: list[Pick] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    lost_twice: bool = False  # the error: its shard group lost twice under it (a retry may pass)
    weights: str | None = None  # the fingerprint of the weights decoding it


@dataclass
class Live:
    seq: EngineSequence
    sent: int = 0  # of its tokens, those handed back


class EngineCore:
    def __init__(self, cfg: ResolvedConfig, source: str) -> None:
        """`source`: what the model loads (as BuiltinEngine's)."""
        self.engine = BuiltinEngine(cfg, source, serving_spec(cfg.checkpoint).model, cfg.fingerprint,
                                    on_iteration=self._collect)
        self.decoding = self.engine.engine
        self.live: dict[str, Live] = {}
        self.outbox: dict[str, Update] = {}
        self._sent = asyncio.Event()  # the outbox has something
        self._window = AsyncExitStack()

    def ready(self) -> str:
        """Answers once the model is loaded: the fingerprint of its weights."""
        return self.engine.weights

    # ------------------------------------------------------------------ requests

    async def submit(self, rid: str, request: Completion) -> None:
        self.live[rid] = Live(self.decoding.submit(request))

    def abandon(self, rid: str) -> None:
        live = self.live.pop(rid, None)
        if live is not None:
            live.seq.abandoned = True  # it leaves at the scheduler's next decision

    async def updates(self) -> dict[str, Update]:
        """Every request's news since the last call, once there is some (one caller: the replica)."""
        await self._sent.wait()
        self._sent.clear()
        news, self.outbox = self.outbox, {}
        return news

    def _collect(self) -> None:
        """After each turn of the engine's loop: what every live request got, into the outbox."""
        for rid, live in list(self.live.items()):
            out, request = live.seq.out, live.seq.request
            if out.empty():
                continue
            update = self.outbox.setdefault(rid, Update())
            while not out.empty():
                item = out.get_nowait()
                if item is None:
                    update.finished = True
                elif isinstance(item, BaseException):
                    update.error, update.lost_twice = str(item), isinstance(item, LostTwice)
                else:
                    logprobs = request.sampling.logprobs is not None
                    update.picks.append(request.picks[live.sent] if logprobs else Pick(item))
                    live.sent += 1
            update.weights = live.seq.weights
            if update.finished or update.error is not None:
                del self.live[rid]
        if self.outbox:
            self._sent.set()

    # ------------------------------------------------------------------ weights

    def set_weights(self, fingerprint: str) -> None:
        self.engine.weights = fingerprint

    async def stage(self, source: str | Published) -> None:
        await self.engine.stage(source)

    async def open_window(self) -> None:
        await self._window.enter_async_context(self.engine.drained())

    async def close_window(self) -> None:
        await self._window.aclose()

    async def swap(self) -> None:
        await self.engine.swap()

    async def swap_back(self) -> None:
        await self.engine.swap_back()

    async def golden_answers(self, prompts: Sequence[GoldenPrompt]) -> list[str]:
        return await self.engine.golden_answers(prompts)

    # ------------------------------------------------------------------ health and numbers

    async def health(self) -> bool:
        return await self.engine.health()

    async def heal(self) -> None:
        await self.engine.heal()

    def stats(self) -> tuple[EngineStats, int]:
        """The engine's numbers (its latency samples handed over, not kept) and the shard groups
        replaced so far."""
        stats = self.decoding.stats
        taken = replace(stats, phases=dict(stats.phases))
        stats.time_to_first_token_s, stats.inter_token_s = [], []
        return taken, self.engine.rebuilt
