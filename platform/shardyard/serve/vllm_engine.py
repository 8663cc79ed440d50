"""vLLM as the decoding engine (`engine: vllm`) for models vLLM loads: a Hugging Face model
directory, or a training run's Hugging Face model written out as one. vLLM's async engine runs
inside the replica, behind the same routes, guard (auth, body limits and deadlines, error
shape), choice limits, text handling and metrics as the built-in engine: it only replaces what
turns a prompt's tokens into the next tokens. It takes the calls DecodingEngine takes
(`submit`, `tokens`, `stats`), so the app holds either.

Following a run (`follow`), a new checkpoint is written out as a model directory and vLLM
reloads its weights in place (its workers' `reload_weights`) in a drained window: new requests
wait, the running ones finish on the old weights, and the prefix cache is emptied before any
request runs on the new ones.

vLLM is optional (`pip install shardyard[vllm]`; on CPU, vLLM's CPU build, see
../shared/FIELD_NOTES.md). `start_vllm` says why it cannot be used (not installed, a model it
cannot load); the app then serves with the built-in engine and logs the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardyard.checkpoint.published import Published, load_source_part
from shardyard.planner import kv_bytes_per_token
from shardyard.serve.engine import EngineStats
from shardyard.serve.generation import Completion
from shardyard.serve.precision import dtype_name
from shardyard.serve.sampling import Pick
from shardyard.serve.shards import all_finite
from shardyard.spec import HFSpec

_request_ids = itertools.count()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(eq=False)
class VllmRequest:
    """One choice handed to vLLM; `abandoned` (set by the app) makes vLLM drop it."""
    request: Completion
    request_id: str
    arrived: float
    abandoned: bool = False
    weights: str = ""  # the fingerprint of the weights that decode it, once it runs


class VllmEngine:
    def __init__(self, engine: Any, sampling_params: type) -> None:
        self.engine, self.sampling_params = engine, sampling_params
        self.stats = EngineStats()
        self.weights = ""  # the fingerprint of the weights vLLM holds (set by the app)
        self._running = 0
        self._open, self._drained = asyncio.Event(), asyncio.Event()  # made on the replica's loop
        self._open.set()
        self._drained.set()

    async def swap_weights(self, apply: Callable[[], Awaitable[str]]) -> None:
        """New weights in a drained window: requests that arrive meanwhile wait, the running ones
        finish on the weights they started with, then `apply` (which may decode with
        `tokens(..., gated=False)`) reloads them and returns their fingerprint."""
        self._open.clear()
        try:
            await self._drained.wait()
            self.weights = await apply()
        finally:
            self._open.set()

    async def load_weights(self, model_dir: str) -> None:
        """vLLM's workers read the weights of `model_dir` in place of theirs; blocks cached from
        the old weights are dropped."""
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
        if not await self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache after a weight reload")

    def close(self) -> None:
        self.engine.shutdown()

    def submit(self, request: Completion) -> VllmRequest:
        return VllmRequest(request, f"shardyard-{next(_request_ids)}", time.perf_counter())

    def _params(self, request: Completion) -> Any:
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        return self.sampling_params(
            n=1, max_tokens=request.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            min_p=s.min_p, repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, min_tokens=s.min_tokens, ignore_eos=s.ignore_eos,
            logprobs=s.logprobs, logit_bias=dict(s.logit_bias) or None, seed=request.seed,
            detokenize=False, output_kind=RequestOutputKind.DELTA)  # the end of sequence: the model's own

    async def tokens(self, handle: VllmRequest, gated: bool = True) -> AsyncIterator[int]:
        """The choice's tokens as vLLM decodes them (appended to its Completion, with their
        log-probabilities when asked for, as the built-in engine does); vLLM drops the request
        when its caller stops reading or abandons it. A request starts once no weight swap is
        under way (`gated`; a swap's own golden prompts are not)."""
        if gated:
            await self._open.wait()
        request, finished, last = handle.request, False, None
        handle.weights = self.weights
        self._running += 1
        self._drained.clear()
        try:
            async for output in self.engine.generate({"prompt_token_ids": request.prompt}, self._params(request),
                                                     handle.request_id):
                choice = output.outputs[0]
                logprobs = choice.logprobs or [None] * len(choice.token_ids)
                for token, alternatives in zip(choice.token_ids, logprobs):
                    request.tokens.append(token)
                    if request.sampling.logprobs is not None:
                        request.picks.append(_pick(token, alternatives, request.sampling.logprobs))
                    self._count(handle, last)
                    last = time.perf_counter()
                    yield token
                    if handle.abandoned:
                        return
                finished = output.finished
        finally:
            try:
                if not finished:
                    await self.engine.abort(handle.request_id)
            finally:  # counted as running until vLLM has let go of it: a swap waits for that
                self._running -= 1
                if not self._running:
                    self._drained.set()

    def _count(self, handle: VllmRequest, last: float | None) -> None:
        now = time.perf_counter()
        self.stats.tokens += 1
        if last is None:
            self.stats.time_to_first_token_s.append(now - handle.arrived)
        else:
            self.stats.inter_token_s.append(now - last)


def _pick(token: int, alternatives: dict[int, Any] | None, k: int) -> Pick:
    """vLLM's log-probabilities of a step (the chosen token's, and the k likeliest by rank) as the
    built-in sampler reports them."""
    if not alternatives:
        return Pick(token)
    top = sorted(((t, a) for t, a in alternatives.items() if a.rank is not None and a.rank <= k),
                 key=lambda item: item[1].rank)
    return Pick(token, alternatives[token].logprob, tuple((t, a.logprob) for t, a in top))


def vllm_model_directory(checkpoint: str, hf_directory: bool, trust_factory: str | None) -> str | None:
    """A directory vLLM loads: the model directory itself, or a training run's Hugging Face
    model written out as one (in a temporary directory the replica keeps); None for models
    vLLM does not know (the own GPT, custom modules)."""
    from shardyard.checkpoint.layout import read_spec

    if hf_directory:
        return checkpoint
    if not isinstance(read_spec(checkpoint).model, HFSpec):
        return None
    return written_out(checkpoint, trust_factory)


def written_out(source: str | Path | Published, trust_factory: str | None) -> str | None:
    """A run's Hugging Face model (a checkpoint of it, or weights it published) as a model
    directory vLLM reads, in a new temporary directory; None when its weights are not finite
    (a diverged run: nothing is written)."""
    from shardyard.models.hf import export_hf_directory

    model = load_source_part(source, lambda whole: whole, torch.device("cpu"), trust_factory=trust_factory)
    if not all_finite(model):
        return None
    return str(export_hf_directory(model, Path(tempfile.mkdtemp(prefix="shardyard-vllm-"))))


def start_vllm(model_dir: str, num_shards: int, sharding: str, context: int, max_running: int,
               kv_tokens: int, prefix_caching: bool, dtype: torch.dtype) -> VllmEngine | str:
    """vLLM's async engine over `model_dir` (tensor or pipeline parallel over `num_shards`, a KV
    cache of `kv_tokens` positions, in `dtype`: the app's, resolved), or why it cannot serve it. The model's shape comes through
    the spec's HFSpec, the one place (with the model adapter) that reads transformers configs."""
    try:
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as err:
        return f"vLLM is not installed here ({err}); pip install 'shardyard[vllm]'"
    parallel = {"tensor_parallel_size": num_shards} if sharding == "tensor" else {"pipeline_parallel_size": num_shards}
    args = AsyncEngineArgs(model=model_dir, max_model_len=context, max_num_seqs=max_running,
                           enable_prefix_caching=prefix_caching, dtype=dtype_name(dtype),
                           # the app's KV cache size, else vLLM reserves a fraction of the whole
                           # machine, on CPU too, and refuses to start where less is free
                           kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(HFSpec(path=model_dir), dtype),
                           distributed_executor_backend="ray" if num_shards > 1 else None,
                           # A run's model written out without a tokenizer (its data was UTF-8
                           # bytes): token ids in and out are all vLLM is asked for anyway.
                           skip_tokenizer_init=not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES),
                           disable_log_stats=True, **parallel)
    try:
        return VllmEngine(AsyncLLM.from_engine_args(args), SamplingParams)
    except Exception as err:  # noqa: BLE001 - any reason vLLM cannot load it: the built-in engine serves
        return f"vLLM could not load {model_dir}: {type(err).__name__}: {err}"
