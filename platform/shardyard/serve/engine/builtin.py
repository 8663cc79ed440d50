"""The built-in engine as an engine backend (serve/engine/backend.py): a model in the replica's own
process (LocalModel) or a group of shard actors (ShardedModel), decoded by continuous batching
(serve/engine/decoding.py) when it keeps a KV cache, else by static batches (serve/engine/static_batches.py),
fixed in size or measured on each candidate device (adaptive), keeping the device that decodes
fastest within the per-token latency target.

A weight swap reads the candidate beside the served weights on every shard (`stage`), then, in a
window where no request is mid-way (the engine's drained iteration boundary, or between static
batches), swaps, decodes the golden prompts and swaps back on one shard group: the window holds
the group's lock, so no rebuild comes in between.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import torch

from shardyard.checkpoint.published import Published
from shardyard.models.kv_layout import BLOCK_TOKENS
from shardyard.planner import serving_memory
from shardyard.serve.engine.backend import Generation, WeightsRefused
from shardyard.serve.engine.batching import AdaptiveBatchSize, calibrate, prefill_budget
from shardyard.serve.resolved import ResolvedConfig
from shardyard.serve.engine.decoding import DecodingEngine
from shardyard.serve.generation import Completion
from shardyard.serve.engine.golden import GoldenPrompt, greedy_answers
from shardyard.serve.executor.local_model import LocalModel
from shardyard.serve.engine.metrics import ServingMetrics
from shardyard.serve.executor.precision import described, serving_dtype
from shardyard.serve.executor.protocol import ModelExecutor
from shardyard.serve.engine.scheduler import MIN_CHUNK
from shardyard.serve.executor.shards import SHARD_LOST, CachesLost, ShardedModel
from shardyard.serve.engine.static_batches import StaticBatches
from shardyard.spec import GPTSpec, HFSpec, CustomSpec

T = TypeVar("T")

# The replica decodes and batches; its shards compute. Its bundle is small so that README's
# default app (2 shards of 0.75) fits a 2-core machine.
REPLICA_CPUS = 0.5
# How long one probe of the shards answers /healthz: the route is open to anyone, and each probe
# asks every shard.
HEALTH_REUSE_S = 1.0


def model_threads(cfg: ResolvedConfig) -> tuple[int, int]:
    """The OpenMP threads one shard's passes run on, on a CPU: the team, and the threads of a
    one-row decode step. `engine.cpu_threads` sets both; else the team is the replica's CPUs and the
    shard's, rounded up (2 by default), and a one-row step runs on the shard's own, whole (1).
    A pass waits at each of its operations for its slowest thread, so a team as large as the
    machine stalls whenever the replica's streaming, HAProxy, Ray's own processes or a client take
    a core: through `shardyard serve` on a 2-core AMD EPYC, one thread gave a lower time per token
    at one stream and two more tokens/s at 16 (docs/benchmarks.md, "The engine core's threads")."""
    if cfg.engine.cpu_threads:
        return cfg.engine.cpu_threads, cfg.engine.cpu_threads
    return max(1, math.ceil(REPLICA_CPUS + cfg.engine.cpus_per_shard)), max(1, int(cfg.engine.cpus_per_shard))


class BuiltinEngine:
    name = "builtin"

    def __init__(self, cfg: ResolvedConfig, source: str, spec: GPTSpec | HFSpec | CustomSpec, weights: str,
                 metrics: ServingMetrics | None = None,
                 on_iteration: Callable[[], None] | None = None) -> None:
        """`source`: the checkpoint (or run, or model directory) the model loads, at start and at
        every rebuild; `spec`: its model's; `weights`: their fingerprint. `metrics`: where static
        batches count as they decode (required for them; continuous batching is read by
        `report`). `on_iteration`: the continuous-batching
        engine's hook (serve/engine/decoding.py)."""
        self.cfg, self.source, self.spec, self.metrics = cfg, source, spec, metrics
        self.on_iteration = on_iteration
        self.rebuilt = self._rebuilds_reported = 0  # shard groups replaced by heal
        self.block_size = spec.block_size
        self.codec, self.stop_token = cfg.codec, cfg.stop_token
        self.engine: DecodingEngine | None = None
        self.batches: StaticBatches | None = None
        self._weights = weights
        self._health, self._probing = (float("-inf"), False), asyncio.Lock()  # (when, healthy): the last probe
        # A swap's blocking calls (the lock, the swap, the golden passes, the swap back) run on
        # one thread: the group's lock is held across them.
        self._window = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardyard-swap")
        self.bounded = cfg.batching.mode == "continuous"  # static batches slide over the context
        if self.bounded:
            self._start_engine()
        else:
            self._start_static()

    @property
    def weights(self) -> str:
        return self._weights

    @weights.setter
    def weights(self, fingerprint: str) -> None:
        self._weights = fingerprint
        if self.engine is not None:  # new weights: it empties its caches when the window ends
            self.engine.weights = fingerprint

    # ------------------------------------------------------------------ starting

    def _model(self, use_gpu: bool) -> ModelExecutor:
        cfg, dtype = self.cfg, serving_dtype(self.cfg.engine.dtype, use_gpu, self.cfg.checkpoint)
        if cfg.engine.num_shards == 1:  # decoded in this process: its bundle holds the shard's CPUs
            team, one_row = model_threads(cfg)
            torch.set_num_threads(team)
            return LocalModel(self.source, use_gpu, cfg.cache_blocks, cfg.trust_factory, dtype,
                              compile_for=cfg.batching.max_batch_size if cfg.compiles(use_gpu) else 0,
                              paged=cfg.engine.paged_attention(use_gpu), one_row_threads=one_row)
        return ShardedModel(self.source, cfg.engine.num_shards, use_gpu, cfg.engine.multi_node, cfg.engine.sharding,
                            cpus_per_shard=cfg.engine.cpus_per_shard, cache_blocks=cfg.cache_blocks,
                            trust_factory=cfg.trust_factory, dtype=dtype, paged=cfg.engine.paged_attention(use_gpu))

    def _start_engine(self) -> None:
        """The shard group and the continuous-batching engine, its prefill budget measured."""
        cfg = self.cfg
        self.model = self._model(cfg.use_gpu)
        budget = prefill_budget(self.model.forward, self.block_size, cfg.batching.max_batch_size,
                                cfg.batching.token_latency_target_ms / 1000)
        self.engine = DecodingEngine(self.model.forward, cfg.batching.max_batch_size, self.block_size, cfg.cache_blocks,
                                     budget, lambda: self._heal(rebuild_if_slow=True), (*SHARD_LOST, CachesLost),
                                     min_chunk=MIN_CHUNK if cfg.engine.chunked_prefill else self.block_size,
                                     prefix_caching=cfg.engine.prefix_caching, weights=self.weights,
                                     packs=self.model.cache_attends, executor=self.model.executor,
                                     times=getattr(self.model, "times", None), on_iteration=self.on_iteration)
        paged = cfg.engine.paged_attention(cfg.use_gpu)
        memory = serving_memory(self.spec, self.model.dtype, cfg.cache_blocks * BLOCK_TOKENS,
                                cfg.batching.max_batch_size, cfg.use_gpu, paged)
        print(f"shardyard: continuous batching in {described(self.model.dtype, cfg.use_gpu)}, up to "
              f"{cfg.batching.max_batch_size} requests at once, a KV cache of "
              f"{cfg.cache_blocks} blocks of {BLOCK_TOKENS} tokens (prefix caching "
              f"{'on' if cfg.engine.prefix_caching else 'off'}; attention "
              f"{'paged' if paged else 'over lanes'}), prefill budget {budget.tokens} tokens per iteration, "
              f"decode steps {'compiled' if getattr(self.model, 'decode', None) else 'eager'}"
              + ("" if cfg.use_gpu or cfg.engine.num_shards > 1 else f" on {self._threads_said()}")
              + (f"; memory {memory}" if memory else ""), flush=True)

    def _threads_said(self) -> str:
        """The CPU threads the model's passes run on, as the replica's log says them."""
        team, one_row = model_threads(self.cfg)
        said = f"{team} CPU thread{'s' if team > 1 else ''}"
        switches = getattr(self.model, "step_threads", None) is not None  # not where decode steps compile
        return said + (f" ({one_row} for a one-row decode step)" if switches else "")

    def _start_static(self) -> None:
        """Static batches from the config, or (adaptive) measured on each candidate device."""
        cfg = self.cfg
        if cfg.batching.mode != "adaptive":
            self.model = self._model(cfg.use_gpu)
            self.batches = StaticBatches(self.model, self.block_size, self.metrics, lambda: self.weights)
            if cfg.batching.mode == "none":
                self.batches.set_batching(1, 0.0)
            else:
                self.batches.set_batching(cfg.batching.max_batch_size, cfg.batching.batch_wait_timeout_s)
            return
        target = cfg.batching.token_latency_target_ms / 1000
        # A GPU is not always faster: a small model's steps can be all transfer overhead.
        devices = [True, False] if cfg.use_gpu and cfg.engine.device == "auto" else [cfg.use_gpu]
        calibrations, model = {}, None
        for use_gpu in devices:
            if model is not None:
                model.close()
            model = self._model(use_gpu)
            calibrations[use_gpu] = calibrate(model.forward, self.block_size, cfg.batching.max_batch_size)

        def best_rate(use_gpu: bool) -> float:
            c = calibrations[use_gpu]
            return c.tokens_per_s(c.best_size(target))

        chosen = max(calibrations, key=best_rate)
        if chosen != devices[-1]:
            model.close()
            model = self._model(chosen)
        self.model, calibration = model, calibrations[chosen]
        size = calibration.best_size(target)
        self.batches = StaticBatches(self.model, self.block_size, self.metrics, lambda: self.weights,
                                     AdaptiveBatchSize(size, cfg.batching.max_batch_size, target))
        self.batches.set_batching(size, calibration.wait_timeout_s(size))
        print(f"shardyard: adaptive batching on {'cuda' if chosen else 'cpu'}: step seconds by batch size "
              f"{ {b: round(t, 4) for b, t in calibration.step_s.items()} }; max_batch_size {size}, "
              f"wait {calibration.wait_timeout_s(size):.4f} s", flush=True)

    # ------------------------------------------------------------------ decoding

    def generate(self, request: Completion) -> Generation:
        if self.engine is None:
            return self.batches.generate(request)
        seq, engine = self.engine.submit(request), self.engine
        return Generation(request, engine.tokens(seq), lambda: setattr(seq, "abandoned", True),
                          lambda: seq.weights or engine.weights)

    # ------------------------------------------------------------------ weight swaps

    async def stage(self, source: str | Published) -> None:
        if not await asyncio.to_thread(self.model.prepare, source):
            await asyncio.to_thread(self.model.drop_staged)
            raise WeightsRefused("has weights that are not finite")

    @asynccontextmanager
    async def drained(self) -> AsyncIterator[None]:
        lock = self.model.exclusive()
        try:
            async with self.engine.drained() if self.engine is not None else self.batches.gate.exclusive():
                await self._in_window(lock.acquire)
                try:
                    yield
                finally:
                    await self._in_window(lock.release)
        finally:
            await asyncio.to_thread(self.model.drop_staged)

    async def swap(self) -> None:
        await self._in_window(self.model.swap)

    async def swap_back(self) -> None:
        await self._in_window(self.model.swap_back)

    async def golden_answers(self, prompts: Sequence[GoldenPrompt]) -> list[str]:
        try:
            return await self._in_window(greedy_answers, self.model.forward, prompts, self.codec, self.block_size,
                                         self.stop_token)
        except SHARD_LOST:
            raise
        except RuntimeError as err:  # a golden prompt's token could not be chosen (NaN logits)
            raise WeightsRefused(f"a golden prompt could not be decoded ({err})") from None

    async def _in_window(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._window, call, *args)

    # ------------------------------------------------------------------ health

    async def health(self) -> bool:
        """Whether every shard answers, probed at most once per HEALTH_REUSE_S however often asked."""
        async with self._probing:
            if time.monotonic() - self._health[0] > HEALTH_REUSE_S:
                self._health = (time.monotonic(), await asyncio.to_thread(self.model.healthy))
            return self._health[1]

    async def heal(self) -> None:
        await asyncio.to_thread(self._heal)

    def _heal(self, rebuild_if_slow: bool = False) -> None:
        """A group with a dead shard is rebuilt (one being rebuilt, or already replaced, is kept):
        Serve's health check, and the engine's call after a forward pass failed (then a shard
        that does not answer counts as lost too)."""
        if self.model.heal(rebuild_if_slow):
            self.rebuilt += 1

    async def report(self, metrics: ServingMetrics) -> None:
        if self.rebuilt > self._rebuilds_reported:
            metrics.rebuilds.inc(self.rebuilt - self._rebuilds_reported)
            self._rebuilds_reported = self.rebuilt
        if self.engine is not None:
            metrics.read_engine(self.engine.stats)
        else:
            metrics.max_batch_size.set(self.batches.limit)

    def close(self) -> None:
        self.model.close()
        self._window.shutdown(wait=False)
