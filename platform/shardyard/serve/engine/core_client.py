"""The replica's side of the engine core (serve/engine/core.py), as an engine backend
(serve/engine/backend.py): the routes generate, the gate swaps weights, and every call crosses to
the core's process as one actor call. Each request's tokens come back through one long poll that
takes a whole step's news for all requests at once, so the replica's event loop (HTTP, streaming,
detokenizing) and the core's step loop never wait for each other.

A core that dies fails the requests it held with EngineCoreLost (answered 503, retry) and the
replica starts another on the weights it served; requests that arrive meanwhile wait for it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import ExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardyard.checkpoint.published import Published
from shardyard.serve.engine.backend import EngineCoreLost, Generation
from shardyard.serve.engine.builtin import REPLICA_CPUS
from shardyard.serve.engine.core import EngineCore, Update
from shardyard.serve.engine.decoding import PHASES, EngineStats, check_fits, queued_tokens
from shardyard.serve.engine.golden import GoldenPrompt
from shardyard.serve.engine.metrics import ServingMetrics
from shardyard.serve.engine.scheduler import LostTwice
from shardyard.serve.executor.checkpoint_holds import hold_served
from shardyard.serve.executor.placement import bundle_actor_options, shard_bundle
from shardyard.serve.generation import Completion
from shardyard.serve.resolved import ResolvedConfig

_EngineCoreActor = ray.remote(max_restarts=0)(EngineCore)


def decodes_in_core(cfg: ResolvedConfig) -> bool:
    """The built-in engine's continuous batching runs in an engine core; static batches and vLLM
    (which has its own engine process) run in the replica."""
    return cfg.engine.backend == "builtin" and cfg.batching.mode == "continuous"


def replica_bundles(cfg: ResolvedConfig) -> list[dict[str, float]]:
    """A replica's placement group when its model is not in its own process: its own bundle (HTTP
    and streaming), then the model's: the one shard's, which its engine core runs in, or one per
    shard (driven by an engine core sharing the replica's bundle, or by static batches in it)."""
    engine = cfg.engine
    if engine.num_shards == 1:
        return [{"CPU": REPLICA_CPUS}, {**shard_bundle(cfg.use_gpu, engine.cpus_per_shard), **engine.device_resources}]
    return [{"CPU": REPLICA_CPUS}] + [shard_bundle(cfg.use_gpu, engine.cpus_per_shard)] * engine.num_shards


def core_options(cfg: ResolvedConfig) -> dict[str, Any]:
    """Where the core runs in its replica's placement group (replica_bundles). A core driving shards
    captures the group for them (serve/executor/placement.py finds their bundles in it)."""
    group = get_current_placement_group()
    if group is None:
        raise RuntimeError("an engine core runs in its replica's placement group: serve the app built by build_app")
    if cfg.engine.num_shards == 1:
        return bundle_actor_options(group.bundle_specs[1], group, 1)
    return {"num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}


@dataclass(eq=False)
class Request:
    """One request on the replica's side: its own Completion takes the core's picks as they come."""
    request: Completion
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # tokens; None when done; an error
    submitted: bool = False
    weights: str | None = None
    streamed: bool = False  # a token has gone out: it cannot be started again unseen
    resubmitted: bool = False


class EngineCoreClient:
    name = "builtin"
    bounded = True

    def __init__(self, cfg: ResolvedConfig, source: str, context: int) -> None:
        """`source`: what a core's model loads (BuiltinEngine's); `context`: the model's tokens
        per sequence. `start` starts the first core."""
        self.cfg, self.source, self.context = cfg, source, context
        self._weights = cfg.fingerprint
        self._core: Any = None  # the live core's handle; None while one starts
        self._restarting: asyncio.Task | None = None
        self._failed: str | None = None  # why the last replacement could not start
        self._poller: asyncio.Task | None = None
        self._live: dict[str, Request] = {}
        self._ids = itertools.count()
        self._served: str | Published = source  # what serves now, and what was staged beside it
        self._staged: str | Published | None = None
        self._inter_token: list[float] = []
        # What cores that died had counted, and their shard groups rebuilt: the counters go on from it.
        self._earlier, self._last = (EngineStats(), 0), (EngineStats(), 0)
        self._rebuilds_reported = 0
        self.cores_started = 0

    @property
    def weights(self) -> str:
        return self._weights

    @weights.setter
    def weights(self, fingerprint: str) -> None:
        self._weights = fingerprint
        if self._core is not None:  # in the gate's window: before its end, which empties the caches
            self._core.set_weights.remote(fingerprint)

    # ------------------------------------------------------------------ the core's life

    async def start(self) -> None:
        """A core with its model loaded, serving what this replica serves. The checkpoint is held
        meanwhile: training does not prune it between the replica choosing it and the core's model
        holding it."""
        with ExitStack() as hold:
            hold_served(self.source, self.source, hold)
            core = _EngineCoreActor.options(**core_options(self.cfg)).remote(self.cfg, self.source)
            await core.ready.remote()
        if self._served != self.source:  # a replacement: back to the weights the gate let through
            await core.stage.remote(self._served)
            await core.open_window.remote()
            await core.swap.remote()
            await core.close_window.remote()
        core.set_weights.remote(self._weights)
        self.cores_started += 1
        self._core, self._failed = core, None
        self._poller = asyncio.get_running_loop().create_task(self._poll(core))
        for rid, request in self._live.items():  # those that came while it started
            self._submit(rid, request)

    async def _poll(self, core: Any) -> None:
        """The core's news, step by step, into each request's queue."""
        try:
            while True:
                news: dict[str, Update] = await core.updates.remote()
                for rid, update in news.items():
                    if (request := self._live.get(rid)) is not None:
                        self._take(rid, request, update)
        except RayActorError:
            self._lost(core)

    def _take(self, rid: str, request: Request, update: Update) -> None:
        request.weights = update.weights or request.weights
        request.streamed = request.streamed or bool(update.picks)
        for pick in update.picks:
            request.out.put_nowait(request.request.accept(pick))
        if update.error is not None:
            request.out.put_nowait((LostTwice if update.lost_twice else RuntimeError)(update.error))
        elif update.finished:
            request.out.put_nowait(None)
        else:
            return
        del self._live[rid]

    def _lost(self, core: Any) -> None:
        """The core died: a request it had streamed from fails; one with nothing out yet (it may
        have reached the core after its death) goes to the next core, once, as if it had come
        while that one started."""
        if core is not self._core:
            return
        self._core, self._earlier = None, self._last
        cut = [rid for rid, request in self._live.items()
               if request.submitted and (request.streamed or request.resubmitted)]
        print(f"shardyard: the engine core died under {len(cut)} streaming requests; starting another", flush=True)
        for rid in cut:
            self._live.pop(rid).out.put_nowait(EngineCoreLost("the engine core was lost under this request; retry"))
        for request in self._live.values():
            if request.submitted:
                request.submitted, request.resubmitted = False, True
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        try:
            await self.start()
        except Exception as err:  # noqa: BLE001 - said, then Serve's health check replaces the replica
            self._failed = f"{type(err).__name__}: {err}"
            print(f"shardyard: the engine core could not be restarted ({self._failed})", flush=True)
            for rid in list(self._live):
                self._live.pop(rid).out.put_nowait(EngineCoreLost(f"the engine core could not restart: {self._failed}"))

    def _core_now(self) -> Any:
        if self._core is None:
            raise EngineCoreLost("the engine core is restarting; retry")
        return self._core

    # ------------------------------------------------------------------ decoding

    def generate(self, request: Completion) -> Generation:
        check_fits(request, self.context, self.cfg.cache_blocks)
        if self._failed is not None:
            raise EngineCoreLost(f"the engine core could not restart: {self._failed}")
        rid, handle = str(next(self._ids)), Request(request)
        self._live[rid] = handle
        if self._core is not None:
            self._submit(rid, handle)
        return Generation(request, queued_tokens(handle.out, self._inter_token), lambda: self._abandon(rid),
                          lambda: handle.weights or self._weights)

    def _submit(self, rid: str, request: Request) -> None:
        if not request.submitted:
            self._core.submit.remote(rid, request.request)  # a core that died: the poll finds out
            request.submitted = True

    def _abandon(self, rid: str) -> None:
        request = self._live.pop(rid, None)
        if request is not None and request.submitted and self._core is not None:
            self._core.abandon.remote(rid)

    # ------------------------------------------------------------------ weight swaps

    async def stage(self, source: str | Published) -> None:
        await self._core_now().stage.remote(source)
        self._staged = source

    @asynccontextmanager
    async def drained(self) -> AsyncIterator[None]:
        core = self._core_now()
        await core.open_window.remote()
        try:
            yield
        finally:
            with suppress(RayActorError):  # a core that died: its replacement starts on the served weights
                await core.close_window.remote()

    async def swap(self) -> None:
        await self._core_now().swap.remote()
        self._served, self._staged = self._staged, self._served

    async def swap_back(self) -> None:
        await self._core_now().swap_back.remote()
        self._served, self._staged = self._staged, self._served

    async def golden_answers(self, prompts: Sequence[GoldenPrompt]) -> list[str]:
        return await self._core_now().golden_answers.remote(list(prompts))

    # ------------------------------------------------------------------ health and numbers

    async def health(self) -> bool:
        if self._core is None:
            return False
        try:
            return await self._core.health.remote()
        except RayActorError:
            return False  # the poll finds out and starts another

    async def heal(self) -> None:
        """A shard group's rebuild, in the core; a core that cannot be restarted fails the check
        (Serve then replaces the replica)."""
        if self._failed is not None:
            raise RuntimeError(f"the engine core could not be restarted: {self._failed}")
        if self._core is not None:
            with suppress(RayActorError):
                await self._core.heal.remote()

    async def report(self, metrics: ServingMetrics) -> None:
        if self._core is None:
            return
        try:
            stats, rebuilt = await self._core.stats.remote()
        except RayActorError:
            return
        earlier, rebuilt_earlier = self._earlier
        stats.tokens += earlier.tokens
        stats.iterations += earlier.iterations
        stats.phases = {phase: stats.phases[phase] + earlier.phases[phase] for phase in PHASES}
        rebuilt += rebuilt_earlier
        self._last = (replace(stats, time_to_first_token_s=[], inter_token_s=[]), rebuilt)
        stats.inter_token_s, self._inter_token = self._inter_token, []
        if rebuilt > self._rebuilds_reported:
            metrics.rebuilds.inc(rebuilt - self._rebuilds_reported)
            self._rebuilds_reported = rebuilt
        metrics.read_engine(stats)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._core is not None:
            ray.kill(self._core, no_restart=True)
