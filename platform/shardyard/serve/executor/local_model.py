"""A language model that fits one device, decoded inside the replica's own process: no shard
actor, so no hop per decoding step (each step of a one-shard group crosses from the replica to the
shard actor and back). The same calls as ShardedModel, so the engine and the static batches run
over either; the replica's own bundle holds the CPUs (and GPU) a shard's would have.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager

import torch

from shardyard.checkpoint.layout import serving_spec, trusted
from shardyard.checkpoint.loaders import servable
from shardyard.checkpoint.published import Published, load_source_part
from shardyard.models.kv_cache import KVCache
from shardyard.models.kv_layout import CacheStep
from shardyard.runtime import select_device
from shardyard.serve.executor.compiled_decode import GEMMS, CompiledDecode
from shardyard.serve.executor.model_thread import ModelThread, StepThreads, one_intra_op_thread
from shardyard.serve.executor.packed_linear import pack_linears
from shardyard.serve.executor.precision import cast_for_serving
from shardyard.serve.sampling import Outcome
from shardyard.serve.executor.checkpoint_holds import CheckpointHolds, hold_served
from shardyard.serve.executor.model_pass import Draws, Extra, PassTimes, model_output, run_model
from shardyard.serve.executor.staged_weights import StagedWeights
from shardyard.spec import LANGUAGE_MODELS


class LocalModel:
    def __init__(self, source: str, use_gpu: bool = False, cache_blocks: int = 0,
                 trust_factory: str | None = None, dtype: torch.dtype = torch.float32,
                 compile_for: int = 0, paged: bool = False, one_row_threads: int = 0,
                 gemms: str = GEMMS) -> None:
        """`source`: a checkpoint, a model directory, or a run directory (its newest committed
        checkpoint, held while served). `cache_blocks`: blocks (of BLOCK_TOKENS positions) the KV
        cache holds (0: none). `dtype`: the weights' (and so the KV cache's) dtype
        (serve/executor/precision.py). `compile_for`: decode steps of up to this many requests run compiled
        (serve/executor/compiled_decode.py; 0: every pass eager). `paged`: attention reads the KV
        cache's blocks in place (models/kv_cache.py). `one_row_threads`: on a CPU, eager one-row
        decode steps run on that many OpenMP threads, the other passes on the caller's (0: all on
        the caller's; a compiled step keeps the count it was compiled with). `gemms`: the kernels a
        compiled CPU step's products are chosen from (CompiledDecode)."""
        found = servable(source)
        if found is None:
            raise ValueError(f"no checkpoint at {source!r}")
        self.holds = CheckpointHolds()
        self.checkpoint_dir = hold_served(source, str(found), self.holds.served)
        spec = trusted(serving_spec(self.checkpoint_dir), self.checkpoint_dir, trust_factory).model
        if not isinstance(spec, LANGUAGE_MODELS):
            self.holds.close()
            raise ValueError(f"{self.checkpoint_dir} holds a '{spec.name}' model; this is for language models")
        self.block_size = spec.block_size
        self.device = select_device(0) if use_gpu else torch.device("cpu")
        self.trust_factory, self.dtype = trust_factory, dtype
        self.packs = not compile_for  # the compiler lays out linear weights its own way
        self.thread = ModelThread()  # loads the model and runs every pass: serve/executor/model_thread.py says why
        self.executor = self.thread.executor  # where the engine calls `forward`: the pass runs there directly
        self.weights = StagedWeights(self._load)
        try:
            self.thread.run(self.weights.load, self.checkpoint_dir)
        except BaseException:
            self.close()
            raise
        self.cache_attends = getattr(self.weights.serving, "cache_attends", False)  # KVCache: packed passes run
        self.cache = KVCache(cache_blocks, paged=paged) if cache_blocks else None
        # Paged attention inside a compiled CPU graph failed in Inductor's C++ FlexAttention kernel
        # (torch 2.13: a graph that does not build), so those decode steps stay eager there.
        compiles = compile_for and self.cache is not None and self.cache_attends
        self.decode = (CompiledDecode(self.cache, compile_for, self.block_size, self.device, gemms)
                       if compiles and not (paged and self.device.type == "cpu") else None)
        if self.decode is None and not self.packs:  # nothing compiles after all (a model attending itself)
            self.packs = True
            self.weights.serving = self.thread.run(pack_linears, self.weights.serving)
        if self.decode is not None:
            self.thread.run(self._warm_up)
        team = self.thread.run(torch.get_num_threads)
        self.step_threads = (StepThreads(team, one_row_threads)
                             if one_row_threads and one_row_threads != team and self.device.type == "cpu"
                             and self.decode is None else None)
        self.rebuilds = 0  # nothing here dies apart from the replica, which Serve replaces
        self.times = PassTimes()  # the passes' time, for the engine's per-step figures
        self._lock = threading.RLock()  # one forward pass at a time over the one cache

    @property
    def model(self) -> torch.nn.Module:
        """The weights that serve now."""
        return self.weights.serving

    def _load(self, source: str | Published) -> torch.nn.Module:
        model = load_source_part(source, lambda m: cast_for_serving(m, self.dtype), self.device,
                                 trust_factory=self.trust_factory)
        return pack_linears(model) if self.packs else model

    def prepare(self, source: str | Published) -> bool:
        """Reads a checkpoint (held from now on) or published weights beside the serving weights
        while passes go on; whether its weights are finite."""
        with one_intra_op_thread():  # beside the passes, without a second OpenMP team
            return self.weights.prepare(self.holds.stage(source))

    def swap(self) -> None:
        """The prepared weights serve from now on and the served ones wait beside them: a second
        swap puts them back, `drop_staged` frees them."""
        with self._lock:
            self.weights.swap()
            self.checkpoint_dir = self.holds.swap(self.checkpoint_dir)

    def swap_back(self) -> None:
        self.swap()

    def exclusive(self) -> AbstractContextManager:
        """Held, no other caller's pass comes in between."""
        return self._lock

    def drop_staged(self) -> None:
        self.weights.drop()
        self.holds.drop()

    def forward(self, tokens: torch.Tensor, extra: Extra = None, draws: Draws = None) -> torch.Tensor | list[Outcome]:
        with self._lock:
            return self.thread.run(self._forward, tokens, extra, draws)

    @torch.no_grad()
    def _warm_up(self) -> None:
        self.decode.warm_up(self.weights.serving, self.device)

    @torch.no_grad()
    def _forward(self, tokens: torch.Tensor, extra: Extra, draws: Draws) -> torch.Tensor | list[Outcome]:
        extra = extra.to(self.device) if isinstance(extra, torch.Tensor) else extra
        tokens = tokens.to(self.device)
        if self.step_threads is not None:
            self.step_threads.enter(tokens)
        started = time.perf_counter()
        attended = self.cache.attention_s if self.cache is not None else 0.0
        logits = None
        if self.decode is not None and isinstance(extra, CacheStep) and not extra.reset:
            logits = self.decode(self.weights.serving, tokens, extra)
        if logits is None:
            logits = run_model(self.weights.serving, tokens, extra, self.cache)
        modelled = time.perf_counter()
        try:
            return model_output(logits, extra, draws)
        finally:
            times = self.times
            times.passes += 1
            times.model_s += modelled - started
            times.sampling_s += time.perf_counter() - modelled
            if self.cache is not None:
                times.attention_s += self.cache.attention_s - attended

    def healthy(self, timeout_s: float = 5.0) -> bool:
        return True  # in the replica's process: if the replica answers, so does the model

    def heal(self, rebuild_if_slow: bool = False, timeout_s: float = 5.0) -> bool:
        return False  # no shard to lose

    def rebuild(self, failed: int | None = None) -> bool:
        return False

    def close(self) -> None:
        self.thread.close()
        self.holds.close()
