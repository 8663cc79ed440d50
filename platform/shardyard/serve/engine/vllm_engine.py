"""vLLM as the decoding engine (`engine: vllm`) for models vLLM loads: a Hugging Face model
directory, or a training run's Hugging Face model written out as one. vLLM's async engine runs
inside the replica, behind the same routes, guard (auth, body limits and deadlines, error
shape), choice limits, text handling and metrics as the built-in engine: it only replaces what
turns a prompt's tokens into the next tokens. It is an engine backend (serve/engine/backend.py), as the
built-in engine is, so the routes and the weight gate hold either.

Following a run (`follow`), a new checkpoint is staged by writing it out as a model directory,
and vLLM reloads its weights in place (its workers' `reload_weights`) in a drained window: new
requests wait, the running ones finish on the old weights, and the prefix cache is emptied before
any request runs on the new ones; swapping back reloads the directory served before.

vLLM is optional (`pip install shardyard[vllm]`; on CPU, vLLM's CPU build, which
benchmarks/make_vllm_env.sh installs). `start_vllm` says why it cannot be used (not installed, a model it
cannot load); the app then serves with the built-in engine and logs the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardyard.checkpoint.layout import is_hf_directory, read_spec
from shardyard.checkpoint.published import Published, load_source_part
from shardyard.planner import kv_bytes_per_token
from shardyard.serve.engine.backend import Generation, WeightsRefused
from shardyard.serve.resolved import ResolvedConfig
from shardyard.serve.engine.decoding import EngineStats
from shardyard.serve.generation import Completion, TextCodec
from shardyard.serve.engine.golden import GoldenPrompt, answer_texts, golden_requests
from shardyard.serve.engine.metrics import ServingMetrics
from shardyard.serve.executor.precision import dtype_name
from shardyard.serve.sampling import Pick
from shardyard.serve.executor.model_pass import all_finite
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
    name, bounded = "vllm", True

    def __init__(self, engine: Any, sampling_params: type, model_dir: str, given: bool, codec: TextCodec,
                 stop_token: int | None, trust_factory: str | None) -> None:
        """`model_dir`: what vLLM loaded; `given`: it is the user's own model directory (never
        deleted), not one this replica wrote out."""
        self.engine, self.sampling_params = engine, sampling_params
        self.codec, self.stop_token, self.trust_factory = codec, stop_token, trust_factory
        self.stats = EngineStats()
        self.weights = ""  # the fingerprint of the weights vLLM holds (set by the app)
        self.served_dir, self.staged_dir = model_dir, None
        self.given_dir = model_dir if given else None
        self._running = 0
        self._open, self._drained = asyncio.Event(), asyncio.Event()  # made on the replica's loop
        self._open.set()
        self._drained.set()

    def generate(self, request: Completion) -> Generation:
        handle = VllmRequest(request, f"shardyard-{next(_request_ids)}", request.arrived or time.perf_counter())
        return Generation(request, self.tokens(handle), lambda: setattr(handle, "abandoned", True),
                          lambda: handle.weights or self.weights)

    async def stage(self, source: str | Published) -> None:
        """`source` written out as a model directory beside the served one (nothing is written
        when its weights are not finite)."""
        model_dir = await asyncio.to_thread(written_out, source, self.trust_factory)
        if model_dir is None:
            raise WeightsRefused("has weights that are not finite")
        self._let_go(self.staged_dir)
        self.staged_dir = model_dir

    @asynccontextmanager
    async def drained(self) -> AsyncIterator[None]:
        """Requests that arrive meanwhile wait, the running ones finish on the weights they
        started with; inside, the caller reloads weights and decodes ungated (golden prompts).
        At the end the directory not serving is deleted (unless it is the user's own)."""
        self._open.clear()
        try:
            await self._drained.wait()
            yield
        finally:
            self._open.set()
            self._let_go(self.staged_dir)
            self.staged_dir = None

    async def swap(self) -> None:
        try:
            await self._load(self.staged_dir)
        except BaseException:
            await self._load(self.served_dir)  # a reload that failed half-way: the served weights again
            raise
        self.served_dir, self.staged_dir = self.staged_dir, self.served_dir

    async def swap_back(self) -> None:
        await self._load(self.staged_dir)
        self.served_dir, self.staged_dir = self.staged_dir, self.served_dir

    async def _load(self, model_dir: str) -> None:
        """vLLM's workers read the weights of `model_dir` in place of theirs; blocks cached from
        the old weights are dropped."""
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
        if not await self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache after a weight reload")

    def _let_go(self, model_dir: str | None) -> None:
        if model_dir is not None and model_dir != self.given_dir:
            shutil.rmtree(model_dir, ignore_errors=True)

    async def golden_answers(self, prompts: Sequence[GoldenPrompt]) -> list[str]:
        """The prompts' greedy answers, decoded by vLLM inside the drained window."""
        requests = golden_requests(prompts, self.codec, self.stop_token)
        for request in requests:
            handle = VllmRequest(request, f"shardyard-{next(_request_ids)}", time.perf_counter())
            async for _ in self.tokens(handle, gated=False):
                pass
        return answer_texts(requests, self.codec)

    async def health(self) -> bool:
        return True  # vLLM checks its own workers; a dead one fails its requests and Serve's check

    async def heal(self) -> None:
        pass

    async def report(self, metrics: ServingMetrics) -> None:
        metrics.read_engine(self.stats)

    def close(self) -> None:
        self.engine.shutdown()
        self._let_go(self.served_dir)

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


def start_vllm(cfg: ResolvedConfig, context: int, dtype: torch.dtype) -> VllmEngine | str:
    """vLLM's async engine over the app's model (tensor or pipeline parallel over its shards, a KV
    cache of `max_kv_tokens` positions, in `dtype`: the app's, resolved), or why it cannot serve
    it. The model's shape comes through the spec's HFSpec, the one place (with the model adapter)
    that reads transformers configs."""
    try:
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as err:
        return f"vLLM is not installed here ({err}); pip install 'shardyard[vllm]'"
    given = is_hf_directory(cfg.checkpoint)
    model_dir = vllm_model_directory(cfg.checkpoint, given, cfg.trust_factory)
    if model_dir is None:
        return f"vLLM does not load this '{read_spec(cfg.checkpoint).model.name}' model (only Hugging Face ones)"
    kv_tokens = cfg.engine.max_kv_tokens or cfg.batching.max_batch_size * context
    shards = cfg.engine.num_shards
    parallel = {"tensor_parallel_size": shards} if cfg.engine.sharding == "tensor" else {"pipeline_parallel_size": shards}
    args = AsyncEngineArgs(model=model_dir, max_model_len=context, max_num_seqs=cfg.batching.max_batch_size,
                           enable_prefix_caching=cfg.engine.prefix_caching, dtype=dtype_name(dtype),
                           # the app's KV cache size, else vLLM reserves a fraction of the whole
                           # machine, on CPU too, and refuses to start where less is free
                           kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(HFSpec(path=model_dir), dtype),
                           distributed_executor_backend="ray" if shards > 1 else None,
                           # A run's model written out without a tokenizer (its data was UTF-8
                           # bytes): token ids in and out are all vLLM is asked for anyway.
                           skip_tokenizer_init=not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES),
                           disable_log_stats=True, **parallel)
    try:
        engine = AsyncLLM.from_engine_args(args)
    except Exception as err:  # noqa: BLE001 - any reason vLLM cannot load it: the built-in engine serves
        return f"vLLM could not load {model_dir}: {type(err).__name__}: {err}"
    print(f"shardyard: vLLM's engine serves {model_dir} ({shards} {cfg.engine.sharding} shard(s), up to "
          f"{cfg.batching.max_batch_size} requests at once, prefix caching {'on' if cfg.engine.prefix_caching else 'off'})", flush=True)
    return VllmEngine(engine, SamplingParams, model_dir, given, cfg.codec, cfg.stop_token, cfg.trust_factory)
