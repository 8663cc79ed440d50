"""Decode steps through `torch.compile`: the model's pass for a decode step of 1, 2, 4, ... rows
(a step is padded up to the next bucket; keys are attended to a power-of-two width), over a KV
cache whose tensors never move (`KVCache.fix`). On a GPU the compiled step is replayed as a CUDA
graph (`reduce-overhead`), so a step costs its kernels, not Python's dispatch of each of them and their launches; the KV
cache's tensors are marked static so the graph reads and writes them where they lie. Prompt
chunks, packed passes and steps whose lanes must first be filled run eagerly, as do the rest
where compiling fails: said once, then every step is eager.

The same code path runs on a CPU (inductor's C++ kernels), so the CPU suite exercises it. There
the graph is frozen: the served weights are its constants (they never change: a swap puts a new
model in place, compiled again), so the compiler lays every linear weight out once and folds what
depends on weights alone. Unfrozen, a compiled step multiplied through the BLAS over the plain
weights and lost to the eager step over oneDNN-packed ones (serve/executor/packed_linear.py).
Frozen, each product is also autotuned (`max_autotune`): the compiler writes its own C++ kernel
for it (its GEMM template, over the weight blocked for it) beside oneDNN's, times both and keeps
the faster. A one-row decode step is a matrix-vector product per weight, bound by reading the
weights: oneDNN's read them at about 10 GB/s on this project's 2-core AMD EPYC, the compiler's at
about 23, close to what summing them takes (27). benchmarks/serve_vs_vllm.py's Llama in
bfloat16, in process on that machine: one stream at 4.0 ms a token against 7.2 compiled before
(frozen, oneDNN's products, the guards below; 13 eager), 16 streams at 17.6 against 19.7. The
timing costs start time: its six graphs compiled in 150-220 s instead of 120 (`gemms=""`
skips it). These settings are the compiler's own config (`torch._inductor.config`), which is
per thread, so they are set around each call on the thread that compiles; `torch.compile`'s
`options={"freezing": True}` did not reach the pass that reads it.

Dynamo checks its guards before every call of a compiled graph; those on the module's
attributes and parameters took 0.7 ms a step (one stream's step: 4.7 ms with them). The served
weights never change in place (a swap is another module, compiled anew), so those guards are
skipped; the ones on the step's inputs, which pick the graph, stay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._inductor.config

from shardyard.models.kv_cache import KVCache
from shardyard.models.kv_layout import LANE_POSITIONS, CacheStep, power_of_two
from shardyard.serve.executor.model_pass import run_model

# A CPU step's products: the compiler's C++ template ("CPP") or oneDNN's ("ATEN"), the faster of the two.
GEMMS = "CPP,ATEN"


class CompiledDecode:
    def __init__(self, cache: KVCache, max_running: int, context: int, device: torch.device,
                 gemms: str = GEMMS) -> None:
        """Fixes `cache` (before its first pass) at `max_running` lanes of `context` positions.
        `gemms`: on a CPU, the kernels each product is timed on and chosen from, as the
        compiler's `max_autotune_gemm_backends` names them ("": oneDNN's, untimed)."""
        cache.fix(max_running, context)
        self.cache = cache
        # On a GPU, CUDA graphs (mode "reduce-overhead"): a step replays its kernels.
        graphs = torch._inductor.list_mode_options("reduce-overhead") if device.type == "cuda" else {}
        self.compile_options = {**graphs, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        autotuned = {"max_autotune": True, "max_autotune_gemm_backends": gemms} if gemms else {}
        self.config = {"freezing": True, **autotuned} if device.type == "cpu" else {}
        self.failed: str | None = None
        self.steps = 0  # decode steps run compiled
        self._compiled: tuple[torch.nn.Module, Callable] | None = None  # the model it is for, compiled

    def __call__(self, model: torch.nn.Module, tokens: torch.Tensor, step: CacheStep) -> torch.Tensor | None:
        """Logits (rows, 1, V) of the decode step `step` over `tokens` (rows, 1), compiled, or
        None: the caller runs the step eagerly (not a step that compiles, or compiling failed)."""
        if self.failed is not None or not self.cache.takes_padded(step, tokens.shape[1]):
            return None
        rows = tokens.shape[0]
        padded = torch.zeros((power_of_two(rows), 1), dtype=tokens.dtype, device=tokens.device)
        padded[:rows] = tokens
        self.cache.begin(step, 1, tokens.device, pad_to=padded.shape[0])
        try:
            # A graph's output is overwritten by its next replay: the rows are copied out.
            with torch._inductor.config.patch(**self.config):
                logits = self._for(model)(padded, cache=self.cache)[:rows].clone()
            self.steps += 1
            return logits
        except Exception as err:  # noqa: BLE001 - whatever the compiler raises, the step runs eagerly
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"shardyard: compiling the decode step failed, every step runs eagerly from now on: "
                  f"{self.failed}", flush=True)
            return None

    def warm_up(self, model: torch.nn.Module, device: torch.device) -> None:
        """Compile `model`'s decode graphs before the first request, as vLLM does at start, so no
        request waits for the compiler (on a 2-core CPU tens of seconds a graph): a step of each
        row bucket (few rows read their own lanes, more every lane: two graphs' worth) at the
        narrowest width and again wider (the compiler's first graph is exact, the next ones
        dynamic in rows and width; it treats a size of 1 apart). Called before any request's pass: what
        the steps write (block 0, the first lanes) is written over before it is read. Under
        no_grad, where the passes run."""
        token = torch.zeros((1, 1), dtype=torch.long, device=device)
        run_model(model, token, CacheStep(((0,),), (0,), lanes=(0,), held=(0,)), self.cache)  # allocates, eagerly
        lanes, positions = self.cache.fixed
        buckets = sorted({min(1 << i, lanes) for i in range(lanes.bit_length() + 1)})
        wider = min(LANE_POSITIONS, positions - 1)
        for rows, start in [(rows, start) for start in (1, wider) for rows in buckets]:
            if start < 1:
                continue
            table = (0,) * (start // self.cache.block_tokens + 1)
            self(model, token.expand(rows, 1), CacheStep((table,) * rows, (start,) * rows,
                                                         lanes=tuple(range(rows)), held=(start,) * rows))
        self.steps = 0  # counts clients' steps

    def _for(self, model: torch.nn.Module) -> Callable:
        """`model` compiled (again after a weight swap put another model in its place)."""
        if self._compiled is None or self._compiled[0] is not model:
            # The compiler keeps its graphs by the forward's code, whichever model they were made
            # for, and at its recompile limit (8) runs further shapes eagerly without a word: the
            # graphs of a model no longer served (a weight swap put another in its place) would
            # leave the new one a few graphs and then eager steps. A process serves one model at
            # a time, so the old graphs go.
            torch.compiler.reset()
            # Shapes as the compiler's default takes them: the first step's exactly, then, once a
            # second bucket or width comes, one graph whatever the rows and width (a CUDA graph is
            # still recorded per shape, which costs a replay's time, not a compile's).
            self._compiled = (model, torch.compile(model, options=self.compile_options))
        return self._compiled[1]
