"""A language model too large for one device, split across shard actors: one placement-group
bundle (one device) per shard, each shard holding only its part of the weights.

Pipeline mode: shard i holds a contiguous run of blocks (the first also the embeddings, the last
the final norm and head, split balanced by parameters as in training), and a forward pass hands
the hidden states from shard to shard. On GPUs the chain is a Ray compiled graph: each hop is
a shared-memory (or, across nodes, a network) channel written by one shard and read by the next,
set up once, instead of a task submitted and an object stored per hop per call
(benchmarks/serve_load.py measures both). On CPUs the hops are tasks that pass Ray object
references, still straight from shard to shard, never through the caller: a compiled graph's
reader polls its channel, so every idle shard keeps a core busy, and under load those are the
cores the shards compute on (with 8 streams on 2 cores the tasks served more tokens per second;
the graph won only at one stream).

Pipeline mode splits any model that says how (models/stages.py: the GPT, Hugging Face models
with a `base_model_pp_plan`, a custom module with the hooks); with one shard a model is served whole.

Tensor mode: every shard holds every block, but only its 1/N of each attention and MLP linear
(the model's tensor-parallel plan as training applies it, parallel/tensor.py: the GPT's, or a
Hugging Face model's `base_model_tp_plan`, over a process group of the shard actors);
all shards run each forward pass together and combine partial results with an all-reduce per
attention and per MLP, over torch.distributed rather than through Ray.

Sampling happens where the logits are: a forward pass given each row's draw (serve/sampling.py)
returns the rows' picks, token ids, from the last pipeline shard or tensor rank 0, never the
logits (batch x vocabulary floats per step). The shard actors are in serve/executor/shard_actors.py, their
placement in serve/executor/placement.py.

Any training checkpoint loads here, whatever strategy wrote it, and each shard reads only its part
of it (checkpoint.load_model_part): a model too large for one device never materialises whole.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Literal

import ray
import torch
from ray.dag import InputNode

from shardyard.checkpoint.layout import serving_spec, trusted
from shardyard.checkpoint.loaders import servable
from shardyard.checkpoint.published import Published
from shardyard.layout.capabilities import check_tensor_parallel, pipeline_blocks
from shardyard.models import build_model, repeated_blocks
from shardyard.models.kv_layout import CacheStep
from shardyard.parallel.pipeline import balanced_split
from shardyard.serve.executor.checkpoint_holds import CheckpointHolds, hold_served
from shardyard.serve.executor.model_pass import Draws, Extra
from shardyard.serve.executor.placement import bundle_actor_options, place_shards, shard_bundle
from shardyard.serve.sampling import Outcome
from shardyard.serve.executor.shard_actors import PipelineShard, TensorShard
from shardyard.spec import LANGUAGE_MODELS, CustomSpec, GPTSpec, HFSpec

Sharding = Literal["pipeline", "tensor"]
Health = Literal["ok", "dead", "slow", "rebuilding"]
# Loading a shard of a large model from remote storage takes minutes; one that has not answered
# in this long is not coming.
SHARD_START_S = 600.0
# What a forward pass raises when a shard has died: a task on a dead actor, a closed channel.
SHARD_LOST = (ray.exceptions.RayActorError, ray.exceptions.RayChannelError)


class CachesLost(RuntimeError):
    """The shard group was replaced (by another caller's rebuild) since the last cache step: the
    sequences cached in the old group are gone."""


class StaleCandidate(RuntimeError):
    """The shard group was rebuilt after a candidate was read: the new shards never read it."""


def sharding_problem(spec: GPTSpec | HFSpec | CustomSpec, num_shards: int, sharding: Sharding) -> str | None:
    """Why this model cannot be split this way, or None if it can."""
    if num_shards == 1:
        return None
    try:
        if sharding == "pipeline":
            blocks = pipeline_blocks(spec, training=False)
            if num_shards > blocks:
                return f"cannot split {blocks} blocks into {num_shards} pipeline shards"
        else:
            check_tensor_parallel(spec, num_shards, key="num_shards")
    except ValueError as err:
        return f"{sharding} sharding: {err}"
    return None


class ShardedModel:
    """The caller's handle on a group of shards; rebuilds the group when a shard dies."""

    executor: Executor | None = None  # a pass waits on the shard actors: any thread of asyncio's executor

    def __init__(self, source: str, num_shards: int, use_gpu: bool = False,
                 multi_node: bool = False, sharding: Sharding = "pipeline", compiled: bool | None = None,
                 cpus_per_shard: float = 1.0, cache_blocks: int = 0, trust_factory: str | None = None,
                 dtype: torch.dtype = torch.float32, paged: bool = False) -> None:
        """`source`: a checkpoint, a model directory, or a run directory, whose newest good
        checkpoint each (re)build loads (training may have pruned the one loaded before; a run
        keeps its model, so the split stays valid). `cache_blocks`: blocks (of BLOCK_TOKENS positions)
        each shard's KV cache holds (0: no cache; forward passes then take left padding, not cache
        steps).
        `trust_factory`: a custom model's factory, named by the user (checkpoint/layout.py).
        `dtype`: the shards' weights' (and KV caches') dtype (serve/executor/precision.py).
        `paged`: their attention reads the KV caches' blocks in place (models/kv_cache.py).
        `compiled`: pipeline hops through a Ray compiled graph (default: on GPUs only)."""
        self.source, self.num_shards, self.use_gpu = source, num_shards, use_gpu
        self.trust_factory, self.dtype = trust_factory, dtype
        found = servable(source)
        if found is None:
            raise ValueError(f"no checkpoint at {source!r}")
        self.checkpoint_dir = str(found)
        self.bundle = shard_bundle(use_gpu, cpus_per_shard)
        self.multi_node, self.sharding, self.cache_blocks, self.paged = multi_node, sharding, cache_blocks, paged
        # Tensor shards talk over torch.distributed; pipeline hops default to the graph on GPUs only.
        self.compiled = (use_gpu if compiled is None else compiled) and sharding == "pipeline"
        self.graph = None
        self.holds = CheckpointHolds()
        self._staged_group: int | None = None  # the group that read the candidate (prepare)
        spec = trusted(serving_spec(self.checkpoint_dir), self.checkpoint_dir, trust_factory).model
        if not isinstance(spec, LANGUAGE_MODELS):
            raise ValueError(f"{self.checkpoint_dir} holds a '{spec.name}' model; sharded serving is for language models")
        problem = sharding_problem(spec, num_shards, sharding)
        if problem:
            raise ValueError(problem)
        self.block_size = spec.block_size
        with torch.device("meta"):  # the model's shape only, no weights: to plan the split
            skeleton = build_model(spec)
        self.cache_attends = getattr(skeleton, "cache_attends", False)  # KVCache: packed passes run
        points = balanced_split(skeleton, num_shards) if sharding == "pipeline" and num_shards > 1 else []
        self.ranges = list(zip([0, *points], [*points, len(repeated_blocks(skeleton))]))
        self.whole = num_shards == 1
        self.placement = place_shards(num_shards, self.bundle, multi_node)
        self.shards: list = []
        # One rebuild at a time, and none under a forward pass: Serve's health check and a batch
        # that lost a shard can both see the failure at once. `rebuilds` counts the groups
        # replaced; a caller passes the count it saw fail, so a group already replaced is kept.
        # `_swapping` is held for a whole rebuild (never by a forward pass): a health probe that
        # cannot take it knows a rebuild is under way, and never probes a half-started group.
        self._lock = threading.RLock()
        self._swapping = threading.Lock()
        self.rebuilds = 0
        self._cache_group: int | None = None  # the group the last cache step ran on
        try:
            self._start_shards()
        except BaseException:
            self.close()  # no shard or placement group outlives a group that could not start
            raise

    def _start_shards(self) -> None:
        self._hold_served()
        p = self.placement

        def in_bundle(i: int) -> dict:
            return bundle_actor_options(self.bundle, p.group, p.first_bundle + i)

        if self.sharding == "pipeline":
            last = len(self.ranges) - 1
            self.shards = [PipelineShard.options(**in_bundle(i)).remote(self.checkpoint_dir, start, end, self.whole,
                                                                          i == last, self.use_gpu, self.cache_blocks,
                                                                          self.trust_factory, self.dtype, self.paged)
                           for i, (start, end) in enumerate(self.ranges)]
        else:
            self.shards = [TensorShard.options(**in_bundle(i)).remote(
                self.checkpoint_dir, i, self.num_shards, self.use_gpu, self.cache_blocks, self.trust_factory,
                self.dtype, self.paged)
                for i in range(self.num_shards)]
            host, port = self._started(self.shards[0].host_rendezvous.remote(), "host the shards' rendezvous")
            self._started([s.join.remote(host, port) for s in self.shards], "form their process group")
        self._started([s.describe.remote() for s in self.shards], f"load {self.checkpoint_dir}")  # loaded and ready
        if self.compiled:
            # given[0]: tokens, given[1]: padding counts or a cache step, given[2]: draws or None
            with InputNode() as given:
                node = given[0]
                for shard in self.shards:
                    node = shard.forward.bind(node, given[1], given[2])
            self.graph = node.experimental_compile()

    def _hold_served(self) -> None:
        if not isinstance(self.source, Published):  # a rebuild serving published weights takes them again
            self.checkpoint_dir = hold_served(self.source, self.checkpoint_dir, self.holds.served)

    def prepare(self, source: str | Published) -> bool:
        """Every shard reads its own part of a checkpoint (held from now on) or of published
        weights beside the serving weights; whether every part is finite. Pipeline shards read while passes go on;
        tensor shards read collectively, so passes wait for it (a pass interleaved on one rank and
        not another would pair the wrong collectives)."""
        staged = self.holds.stage(source)
        with ExitStack() as stack:
            if self.sharding == "tensor":
                stack.enter_context(self._lock)
            with self._lock:
                shards, self._staged_group = self.shards, self.rebuilds
            return all(self._started([s.prepare.remote(staged) for s in shards], f"load {staged}"))

    def swap(self) -> None:
        """The prepared weights serve from now on and the served ones wait beside them (a second
        swap puts them back; `drop_staged` frees them); called between passes (the engine's
        caches are emptied after). A rebuild after this loads the swapped-in checkpoint, not the
        run's newest: only weights that passed the gate are ever served. Raises StaleCandidate
        if the group was rebuilt since it read the candidate (its shards hold no such weights)."""
        with self._lock:
            if self._staged_group != self.rebuilds:
                raise StaleCandidate(f"the shard group was rebuilt after {self.holds.staged_dir} was read")
            try:
                self._started([s.swap.remote() for s in self.shards], "swap weights")
            except SHARD_LOST:
                self._staged_group = None  # the rebuilt group reads the served checkpoint
                raise
            self.source = self.checkpoint_dir = self.holds.swap(self.checkpoint_dir)

    def swap_back(self) -> None:
        """Undo `swap`: the weights served before serve again. A shard lost meanwhile gets the
        group rebuilt at the next pass, from the checkpoint served before too."""
        with self._lock:
            self.source = self.checkpoint_dir = self.holds.swap(self.checkpoint_dir)
            try:
                self._started([s.swap.remote() for s in self.shards], "swap weights back")
            except SHARD_LOST:
                pass

    def exclusive(self) -> AbstractContextManager:
        """Held, no rebuild (and no other caller's pass) comes in between: a swap, the passes that
        judge it and the swap back happen on one group."""
        return self._lock

    def drop_staged(self) -> None:
        """Free the weights waiting beside the served ones (and their checkpoint's hold)."""
        with self._lock:
            try:
                self._started([s.drop_staged.remote() for s in self.shards], "drop the other weights")
            except SHARD_LOST:
                pass  # a dead shard's weights went with it; the next pass has the group rebuilt
            self._staged_group = None
            self.holds.drop()

    def _started(self, refs: Any, what: str) -> Any:
        """A start-up call's result; a shard that never answers (a hung load, a node gone) is an
        error that says what it was doing, not a replica that waits forever."""
        try:
            return ray.get(refs, timeout=SHARD_START_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the shards did not {what} within {SHARD_START_S:g} s") from None

    def probe(self, timeout_s: float = 5.0) -> tuple[Health, int]:
        """How the group is: every shard answers (ok), one has died (dead), one does not answer
        within `timeout_s` (slow), or a rebuild is under way (rebuilding); and the `rebuilds`
        count of the group probed."""
        if not self._swapping.acquire(blocking=False):
            return "rebuilding", self.rebuilds
        try:
            shards, group = list(self.shards), self.rebuilds
        finally:
            self._swapping.release()
        try:
            ray.get([s.describe.remote() for s in shards], timeout=timeout_s)
            return "ok", group
        except ray.exceptions.RayActorError:
            return "dead", group
        except ray.exceptions.GetTimeoutError:
            return "slow", group

    def healthy(self, timeout_s: float = 5.0) -> bool:
        return self.probe(timeout_s)[0] == "ok"

    def heal(self, rebuild_if_slow: bool = False, timeout_s: float = 5.0) -> bool:
        """Rebuild the group if a shard of it has died (or, with `rebuild_if_slow`, does not
        answer: a forward pass has already failed on it). A group being rebuilt, or replaced
        since it was probed, is left alone. Returns whether this call rebuilt.

        Serve's health check heals without `rebuild_if_slow`: on a loaded machine a shard may
        answer late, and replacing a working group would cost every running request its cache."""
        health, group = self.probe(timeout_s)
        if health == "dead" or (health == "slow" and rebuild_if_slow):
            return self.rebuild(group)
        return False

    def rebuild(self, failed: int | None = None) -> bool:
        """Replace every shard (a dead one's part must be reloaded; the rest restart with it so
        no half-old group serves). `failed`: the `rebuilds` count of the group the caller saw
        fail; if another caller has replaced that group meanwhile, nothing is done. Returns
        whether this call rebuilt."""
        with self._lock, self._swapping:
            if failed is not None and failed != self.rebuilds:
                return False
            self._stop_shards()
            self.rebuilds += 1
            self._start_shards()
            return True

    def _stop_shards(self) -> None:
        if self.graph is not None:
            self.graph.teardown()
            self.graph = None
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        self.holds.served.close()

    def forward(self, tokens: torch.Tensor, extra: Extra = None, draws: Draws = None) -> torch.Tensor | list[Outcome]:
        """Logits of the whole model, or with `draws` each row's pick. Pipeline: each shard's
        output goes to the next as a Ray reference. Tensor: every shard gets the same input and
        rank 0 returns the result. `extra`: left padding per row, or a KV-cache step (every shard
        applies it to its cache)."""
        with self._lock:  # waits out a rebuild instead of using a half-built group
            if isinstance(extra, CacheStep):
                if not extra.reset and self._cache_group not in (None, self.rebuilds):
                    self._cache_group = None
                    raise CachesLost("the shard group was rebuilt: its KV caches start empty")
                self._cache_group = self.rebuilds
            return self._forward(tokens, extra, draws)

    def _forward(self, tokens: torch.Tensor, extra: Extra, draws: Draws) -> torch.Tensor | list[Outcome]:
        if self.graph is not None:
            return ray.get(self.graph.execute(tokens, extra, draws))
        if self.sharding == "pipeline":
            ref = tokens
            for shard in self.shards:
                ref = shard.forward.remote(ref, extra, draws)
            return ray.get(ref)
        tokens_ref, extra_ref, draws_ref = ray.put(tokens), ray.put(extra), ray.put(draws)
        refs = [shard.forward.remote(tokens_ref, extra_ref, draws_ref) for shard in self.shards]
        pending = refs
        while pending:  # a dead shard raises at once, not after its peers' collective times out
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        return ray.get(refs[0])

    def close(self) -> None:
        self._stop_shards()
        self.holds.close()
        if self.placement.owned:
            ray.util.remove_placement_group(self.placement.group)

