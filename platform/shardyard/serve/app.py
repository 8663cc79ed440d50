"""The HTTP app: a Ray Serve deployment (FastAPI ingress) over a model trained by shardyard,
speaking OpenAI's API (serve/openai_api.py) so that its clients and tools work unchanged.

    POST /v1/completions       prompt (a string or a list), n, max_tokens, stop, seed, stream,
                               logprobs, and sampling: OpenAI's fields and vLLM's extensions
                               (serve/openai_api.py, serve/sampling.py)  -> text_completion
    POST /v1/chat/completions  messages (the tokenizer's chat template, or a plain one) -> chat.completion
    GET  /v1/models            the served model's id (a request naming another gets 404), its step
    POST /admin/rollback       back to the weights the app served before (bearer token; a followed
                               run; every replica: serve/app_weights.py)
    POST /admin/promote        {"step": N}: the run's checkpoint of step N, through the gate, everywhere
    POST /v1/predict           {"inputs": [[float, ...], ...]}        (MLP checkpoints)
    GET  /healthz              200 while every shard answers
    GET  /metrics              Prometheus text: latency, queue time, tokens, engine state

Language models are decoded by the engine (serve/engine.py: KV cache, continuous batching) when
they have a KV cache, else by static batches grouped with `@serve.batch` (ragged prompts
left-padded and masked, so each answer equals the unbatched one), fixed or adaptive in size
(serve/batching.py). Streaming (`stream: true`) sends each choice's text as it is decoded (several
choices interleaved, serve/streams.py), as `data: {chunk}` lines ending with `data: [DONE]`. A
shard lost under a batch gets the shard group rebuilt and the batch resumed where it stopped. Every mistake a client can make gets a 4xx in
OpenAI's error shape with a reason: malformed JSON 400, a prompt beyond the context 400, bad or
missing credentials 401 (checked first, before the body is read), another model or route 404,
body too large 413 (checked before reading it), invalid fields 422 (naming the field), too slow
408 (a body not received within `body_timeout_s` too); a full queue is answered 503 with
Retry-After by Serve itself (`max_queued_requests`), and so is a request whose choices do not fit
beside those the replica is answering (its concurrency counts choices, not requests). Every
error, an unhandled one (500) included, is counted by status and route (serve/guard.py).
"""


import asyncio
import json
import math
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import ray
import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.handle import DeploymentHandle

from shardyard.serve import openai_api as oa
from shardyard.serve.choices import ChoiceText
from shardyard.serve.streams import END, Interleaved
from shardyard.serve.batching import AdaptiveBatchSize, BatchGate, calibrate, prefill_budget
from shardyard.serve.config import parse_config
from shardyard.models.kv_cache import BLOCK_TOKENS
from shardyard.serve.engine import DecodingEngine
from shardyard.serve.scheduler import MIN_CHUNK, LostTwice
from shardyard.serve.ingress import header_deadline_s
from shardyard.serve.guard import ChoiceLimit, ClientError, GuardSettings, error_response, install
from shardyard.serve.generation import Completion, TextCodec, decode_steps
from shardyard.serve.golden import GoldenPrompt, answer_texts, golden_requests, greedy_answers, regressions
from shardyard.serve.rollout import PROMOTE, REFUSE, WAIT, Rollout, Tally
from shardyard.serve.app_weights import AppWeights, Pin, Source, View, rollback_target, starting_checkpoint
from shardyard.checkpoint.published import Published, source_step
from shardyard.serve.local_model import LocalModel
from shardyard.planner import serving_memory
from shardyard.serve.precision import described, serving_dtype
from shardyard.serve.vllm_engine import VllmEngine, start_vllm, vllm_model_directory, written_out
from shardyard.serve.metrics import ServingMetrics, scrape_cluster
from shardyard.serve.shards import SHARD_LOST, CachesLost, ShardedModel, check_room, shard_bundle
from shardyard.spec import LANGUAGE_MODELS, SpecError
from shardyard.checkpoint.loaders import committed_record, load_model
from shardyard.checkpoint.record import BadCheckpoint, checkpoint_name, newest_good, step_of
from shardyard.checkpoint.store import RunStorage
from shardyard.checkpoint.events import read_metrics, validation_loss_at
from shardyard.checkpoint.layout import is_hf_directory, read_spec

api = FastAPI(title="shardyard")
install(api)  # auth and body limits before anything else; one error shape (serve/guard.py)


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: list[list[Annotated[float, Field(allow_inf_nan=False)]]] = Field(min_length=1)  # JSON allows NaN


@dataclass
class Ticket:
    """One completion waiting in (or running in) a static batch."""
    request: Completion
    arrived: float
    abandoned: bool = False  # its caller stopped waiting (timeout, disconnect)
    weights: str = ""  # the fingerprint of the weights its batch decodes on


@dataclass
class Generation:
    """A request being decoded, by the engine or a static batch: its tokens as they come, and
    how to tell the decoder that nobody waits for the rest."""
    request: Completion
    tokens: AsyncIterator[int]
    abandon: Callable[[], None]
    weights: Callable[[], str]  # the fingerprint of the weights decoding it


class WeightsRefused(RuntimeError):
    """A checkpoint the gate keeps from serving (weights that are not finite, or a validation
    loss worse than the served one's)."""


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0, description="the step of a committed checkpoint of the served run")


def _event(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# The replica decodes and batches; its shards compute. Its bundle is small so that README's
# default app (2 shards of 0.75) fits a 2-core machine.
REPLICA_CPUS = 0.5
# Ray starts its workers at niceness 15 (its `worker_niceness`), below its own daemons and every
# other process at 0. vLLM's engine runs a pass on OpenMP threads, one per core, that wait for each
# other at every operation, so any process at 0 waking on a core stalled the whole pass: a replica
# whose engine is vLLM runs at 0 (Ray's job supervisor does the same for job drivers), and vLLM's
# engine and workers, its children, inherit it. The built-in engine's replica stays at 15: at 0 it
# took the cores from Serve's proxy, which Ray keeps at 15 (docs/benchmarks.md, "Serving against
# vLLM", has both measurements).
SERVING_PRIORITY = {"env_vars": {"RAY_worker_niceness": "0"}}
# How often the replica re-publishes its gauges: Ray's exporter drops a gauge not set lately.
PUBLISH_EVERY_S = 1.0
# How long one scrape of the cluster's metrics answers GET /metrics.
SCRAPE_REUSE_S = 2.0
# How long an admin call waits for every replica to serve the weights it chose before answering.
PIN_WAIT_S = 60.0


# Everything ModelServer uses must be defined above it: Serve pickles the class when it is decorated.
@serve.deployment
@serve.ingress(api)
class ModelServer:
    async def __init__(self, config: dict[str, Any], rollout: DeploymentHandle | None = None,
                       app_weights: DeploymentHandle | None = None) -> None:
        """`rollout`: the app's Rollout deployment, with canary_fraction (serve/rollout.py);
        `app_weights`: its AppWeights, following a run (serve/app_weights.py). Following a run, a
        replica starts on the weights the app serves (those it promoted last), not on the run's
        newest checkpoint, which may be refused, on trial, or passed over by an operator."""
        self.config = parse_config(config)
        self.rollout, self.app_weights = rollout, app_weights
        self.replica = serve.get_replica_context().replica_id.unique_id
        if app_weights is not None:
            start = starting_checkpoint(await app_weights.look.remote(self.replica, ""), self.config.source)
            if start is not None:
                self.config = self.config.starting_at(start)
            await app_weights.promote.remote(Path(self.config.checkpoint))
        self.pin_applied = 0  # the serial of the last operator's pin this replica served
        self.tally: dict[str, Tally] = {}  # requests answered, by the weights that answered them
        self.metrics = ServingMetrics()
        api.state.guard = GuardSettings(self.config.max_body_bytes, self.config.bearer_token,
                                        self.config.body_timeout_s, self.metrics.count_error, self.publish_metrics)
        headers = header_deadline_s()
        print("shardyard: request headers " + (f"not received within {headers} s get 408 (Serve's HAProxy ingress)"
              if headers else "have no receive deadline here (Serve's default proxy: see docs/serving.md)"), flush=True)
        self._publisher: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None
        self.served_step, self.fingerprint = self.config.served_step, self.config.fingerprint
        self.run_name = self.fingerprint.rsplit("@", 1)[0]
        self.served: list[Path | Published] = [Path(self.config.checkpoint)]  # every source served, in order
        self.unreachable: set[int] = set()  # steps whose published weights are gone from the object store
        self.follow_after = self.served_step or 0  # the follower serves only steps after this
        self._swapping = asyncio.Lock()
        self._batches = BatchGate()  # static batching: a swap runs between batches
        self.candidate_step: int | None = None  # the checkpoint being read and judged
        self.refused: dict[int, str] = {}  # steps the gate refused, and why: the follower passes them over
        self._golden: tuple[str, list[str]] = ("", [])  # a fingerprint, its golden answers
        self.started = int(time.time())
        self.choices = ChoiceLimit(self.config.concurrency)
        self._scrape, self._scrape_lock = (float("-inf"), ""), asyncio.Lock()
        self.model_spec = model_spec = read_spec(self.config.checkpoint).model
        self.kind = model_spec.name
        self.generates = isinstance(model_spec, LANGUAGE_MODELS)  # else the MLP regressor
        self.adaptive: AdaptiveBatchSize | None = None
        self.engine: DecodingEngine | VllmEngine | None = None
        if self.generates:
            self.tokenizer = self.config.tokenizer
            self.codec = TextCodec(self.tokenizer)
            self.stop_token = getattr(self.tokenizer, "eos_token_id", None)
            self.block_size = model_spec.block_size
            self.vocabulary = model_spec.vocab_size
            self._start_model()
        else:  # the MLP: small, served whole by the replica
            self.mlp = load_model(self.config.checkpoint, self.config.trust_factory).eval()
            self.in_dim = model_spec.in_dim

    def __del__(self) -> None:
        """Serve calls this as it stops the replica: vLLM's engine process goes with it."""
        if isinstance(getattr(self, "engine", None), VllmEngine):
            self.engine.close()

    @property
    def _model_source(self) -> str:
        """Following a run, the checkpoint resolved at start (a rebuild loads the weights the
        gate let through, never a newer checkpoint unchecked); else the checkpoint as given."""
        return self.config.checkpoint if self.config.follow else self.config.source

    def _shards(self, use_gpu: bool) -> ShardedModel | LocalModel:
        cfg = self.config
        if cfg.num_shards == 1:  # decoded in this process: its bundle holds the shard's CPUs
            # Its CPUs as threads, rounded up: the model is what this process spends them on.
            torch.set_num_threads(max(1, math.ceil(REPLICA_CPUS + cfg.cpus_per_shard)))
            return LocalModel(self._model_source, use_gpu, cfg.cache_blocks, cfg.trust_factory, self._dtype(use_gpu),
                              compile_for=cfg.max_batch_size if cfg.compiles(use_gpu) else 0)
        return ShardedModel(self._model_source, cfg.num_shards, use_gpu, cfg.multi_node, cfg.sharding,
                            cpus_per_shard=cfg.cpus_per_shard, cache_blocks=cfg.cache_blocks,
                            trust_factory=cfg.trust_factory, dtype=self._dtype(use_gpu))

    def _dtype(self, use_gpu: bool) -> torch.dtype:
        return serving_dtype(self.config.dtype, use_gpu, self.config.checkpoint)

    def _start_model(self) -> None:
        """Start the shard group and the decoder: the engine (its prefill budget measured), or
        static batches from the config, or measured on each candidate device (adaptive), keeping
        the device that decodes fastest in time."""
        cfg = self.config
        target = cfg.token_latency_target_ms / 1000
        if cfg.engine == "vllm" and self._start_vllm():
            return
        if cfg.batching == "continuous":
            self.model = self._shards(cfg.use_gpu)
            budget = prefill_budget(self.model.forward, self.block_size, cfg.max_batch_size, target)
            self.engine = DecodingEngine(self.model.forward, cfg.max_batch_size, self.block_size, cfg.cache_blocks,
                                         budget, lambda: self._heal(rebuild_if_slow=True), (*SHARD_LOST, CachesLost),
                                         min_chunk=MIN_CHUNK if cfg.chunked_prefill else self.block_size,
                                         prefix_caching=cfg.prefix_caching, weights=self.fingerprint,
                                         packs=self.model.cache_attends, executor=self.model.executor)
            memory = serving_memory(self.model_spec, self.model.dtype, cfg.cache_blocks * BLOCK_TOKENS,
                                    cfg.max_batch_size, cfg.use_gpu)
            print(f"shardyard: continuous batching in {described(self.model.dtype, cfg.use_gpu)}, up to "
                  f"{cfg.max_batch_size} requests at once, a KV cache of "
                  f"{cfg.cache_blocks} blocks of {BLOCK_TOKENS} tokens (prefix caching "
                  f"{'on' if cfg.prefix_caching else 'off'}), prefill budget {budget.tokens} tokens per iteration, "
                  f"decode steps {'compiled' if getattr(self.model, 'decode', None) else 'eager'}"
                  + (f"; memory {memory}" if memory else ""), flush=True)
            return
        if cfg.batching != "adaptive":
            self.model = self._shards(cfg.use_gpu)
            if cfg.batching == "none":
                self._set_batching(1, 0.0)
            else:
                self._set_batching(cfg.max_batch_size, cfg.batch_wait_timeout_s)
            return
        # A GPU is not always faster: a small model's steps can be all transfer overhead.
        devices = [True, False] if cfg.use_gpu and cfg.device == "auto" else [cfg.use_gpu]
        calibrations, model = {}, None
        for use_gpu in devices:
            if model is not None:
                model.close()
            model = self._shards(use_gpu)
            calibrations[use_gpu] = calibrate(model.forward, self.block_size, cfg.max_batch_size)

        def best_rate(use_gpu: bool) -> float:
            c = calibrations[use_gpu]
            return c.tokens_per_s(c.best_size(target))

        chosen = max(calibrations, key=best_rate)
        if chosen != devices[-1]:
            model.close()
            model = self._shards(chosen)
        self.model, calibration = model, calibrations[chosen]
        size = calibration.best_size(target)
        self.adaptive = AdaptiveBatchSize(size, cfg.max_batch_size, target)
        self._set_batching(size, calibration.wait_timeout_s(size))
        print(f"shardyard: adaptive batching on {'cuda' if chosen else 'cpu'}: step seconds by batch size "
              f"{ {b: round(t, 4) for b, t in calibration.step_s.items()} }; max_batch_size {size}, "
              f"wait {calibration.wait_timeout_s(size):.4f} s", flush=True)

    def _start_vllm(self) -> bool:
        """vLLM as the engine, or (logged, with the reason) False: the built-in engine serves."""
        cfg = self.config
        directory = vllm_model_directory(cfg.checkpoint, is_hf_directory(cfg.checkpoint), cfg.trust_factory)
        kv_tokens = cfg.max_kv_tokens or cfg.max_batch_size * self.block_size
        started = (start_vllm(directory, cfg.num_shards, cfg.sharding, self.block_size, cfg.max_batch_size,
                              kv_tokens, cfg.prefix_caching, self._dtype(cfg.use_gpu))
                   if directory else f"vLLM does not load this '{self.kind}' model (only Hugging Face ones)")
        if isinstance(started, str):
            print(f"shardyard: engine: vllm asked for, the built-in engine serves: {started}", flush=True)
            return False
        self.engine, self.model = started, None
        self.engine.weights, self.vllm_dir = self.fingerprint, directory
        print(f"shardyard: vLLM's engine serves {directory} ({cfg.num_shards} {cfg.sharding} shard(s), up to "
              f"{cfg.max_batch_size} requests at once, prefix caching {'on' if cfg.prefix_caching else 'off'})",
              flush=True)
        return True

    def _set_batching(self, max_batch_size: int, wait_timeout_s: float) -> None:
        self._decode.set_max_batch_size(max_batch_size)
        self._decode.set_batch_wait_timeout_s(wait_timeout_s)
        self.batch_limit = max_batch_size

    # ------------------------------------------------------------------ routes

    @api.post("/v1/completions")
    async def completions(self, body: oa.CompletionRequest) -> Any:
        self._expect(generates=True, model=body.model)
        prompts = [self._prompt_tokens(p, body.new_tokens) for p in body.prompt]
        return await self._answer(prompts, body, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: oa.ChatRequest) -> Any:
        self._expect(generates=True, model=body.model)
        prompt = oa.render_chat(body.messages, self.tokenizer)
        return await self._answer([self._prompt_tokens(prompt, body.new_tokens, "messages")], body, chat=True)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_id, "object": "model",
                                            "created": self.started, "owned_by": "shardyard",
                                            "max_model_len": self.block_size if self.generates else None,
                                            "served_step": self.served_step,
                                            "candidate_step": self.candidate_step,
                                            "refused_steps": {str(k): v for k, v in self.refused.items()},
                                            "served_from": ("object store" if isinstance(self.served[-1], Published)
                                                            else "storage"),
                                            "system_fingerprint": self.fingerprint}]}

    def _prompt_tokens(self, text: str, max_tokens: int, field: str = "prompt") -> list[int]:
        cfg = self.config
        if len(text) > cfg.max_prompt_chars:
            raise ClientError(422, f"{field} is {len(text)} characters; the limit is {cfg.max_prompt_chars}", field)
        if max_tokens > cfg.max_tokens_limit:
            raise ClientError(422, f"max_tokens may be at most {cfg.max_tokens_limit}", "max_tokens")
        tokens = self.codec.encode(text)
        if not tokens:
            raise ClientError(422, f"{field} encodes to no tokens", field)
        if self.engine is not None and len(tokens) + max_tokens > self.block_size:
            raise ClientError(400, f"the prompt's {len(tokens)} tokens plus max_tokens {max_tokens} exceed "
                                   f"the model's context of {self.block_size} tokens", field,
                              "context_length_exceeded")
        return tokens

    def _completions(self, prompts: list[list[int]], body: oa.CompletionRequest | oa.ChatRequest) -> list[Completion]:
        """A choice per prompt and per `n`, in OpenAI's order (prompt by prompt); choice j of a
        seeded request draws from seed + j, so its n choices differ and each is reproducible."""
        count, limit = len(prompts) * body.n, self.config.max_choices_per_request
        if count > limit:
            raise ClientError(422, f"{len(prompts)} prompt(s) x n {body.n} = {count} choices; a request may ask "
                                   f"for at most {limit}", "n" if body.n > 1 else "prompt")
        if body.logit_bias and max(body.logit_bias) >= self.vocabulary:
            raise ClientError(422, f"logit_bias names token {max(body.logit_bias)}; the vocabulary has "
                                   f"{self.vocabulary}", "logit_bias")
        sampling = body.sampling()
        return [Completion(p, body.new_tokens, sampling, None if body.seed is None else body.seed + j, self.stop_token)
                for p in prompts for j in range(body.n)]

    async def _answer(self, prompts: list[list[int]], body: oa.CompletionRequest | oa.ChatRequest,
                      chat: bool) -> Any:
        id_ = oa.completion_id(chat)
        requests = self._completions(prompts, body)
        prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:  # counted and decoded once the response streams: a client gone before holds nothing
            self.choices.admit(len(requests))
            options = body.stream_options or oa.StreamOptions()
            return StreamingResponse(self._stream(requests, body.stop, chat, id_, options, prompt_tokens),
                                     media_type="text/event-stream")
        self.choices.take(len(requests))
        gens: list[Generation] = []
        started = time.perf_counter()
        try:
            gens = [self._generate(r) for r in requests]
            choices = [ChoiceText(r, self.codec, body.stop, chat) for r in requests]
            await asyncio.wait_for(asyncio.gather(*(self._collect(g, c) for g, c in zip(gens, choices))),
                                   self.config.request_timeout_s)
        except asyncio.TimeoutError:
            raise ClientError(408, f"not answered within {self.config.request_timeout_s} s") from None
        except (*SHARD_LOST, LostTwice):
            raise ClientError(503, "the model's shards were lost twice under this request; retry") from None
        except RuntimeError as err:  # this request alone failed (the others in its steps go on)
            self._tally(gens[0].weights() if gens else self.fingerprint, 0.0, ok=False)
            raise ClientError(500, f"this request could not be decoded: {err}") from None
        finally:  # answered, timed out or disconnected: its decoder stops computing it
            for gen in gens:
                gen.abandon()
            self.choices.give_back(len(requests))
        out = [oa.choice(i, c.text(), c.finish_reason, chat, logprobs=c.logprobs()) for i, c in enumerate(choices)]
        used = oa.usage(prompt_tokens, sum(len(r.tokens) for r in requests))
        self._tally(gens[0].weights(), time.perf_counter() - started, ok=True)
        return oa.body(id_, self.config.model_id, gens[0].weights(), out, chat, usage=used)

    def _tally(self, weights: str, seconds: float, ok: bool) -> None:
        self.tally.setdefault(weights, Tally()).record(seconds, ok)

    async def _collect(self, gen: Generation, choice: ChoiceText) -> None:
        """A choice's whole text, cut at a stop string."""
        async for token in gen.tokens:
            choice.push(token)
            if choice.stopped:
                gen.abandon()
                return
        choice.finish()

    async def _stream(self, requests: list[Completion], stops: list[str], chat: bool, id_: str,
                      options: oa.StreamOptions, prompt_tokens: int) -> AsyncIterator[str]:
        """OpenAI's stream: chunks of text per choice as it is decoded (a chunk carries every
        token a choice got since its last one), each choice's last with its finish_reason, then
        (if asked) one with the usage, then [DONE]. A character split over several tokens appears
        with its last one (the chunks of the tokens before carry no text, as vLLM's do: sending
        none made a held-back character look like a stall to clients that time each chunk), and
        nothing of a stop string is sent."""
        started = time.perf_counter()
        model, deadline = self.config.model_id, started + self.config.request_timeout_s
        choices = [ChoiceText(r, self.codec, stops, chat) for r in requests]

        def chunk(index: int, piece: str, reason: str | None = None, first: bool = False) -> str:
            used = None
            if options.continuous_usage_stats:
                used = oa.usage(prompt_tokens, sum(len(r.tokens) for r in requests))
            piece_choice = oa.choice(index, piece, reason, chat, delta=True, first=first,
                                     logprobs=choices[index].logprobs())
            return _event(oa.body(id_, model, gens[index].weights(), [piece_choice], chat, chunk=True, usage=used))
        self.choices.hold(len(requests))
        gens: list[Generation] = []
        streams: Interleaved | None = None
        try:
            gens = [self._generate(r) for r in requests]
            streams = Interleaved([g.tokens for g in gens], deadline)
            if chat:
                for index in range(len(choices)):
                    yield chunk(index, "", first=True)
            async for index, tokens in streams:
                choice = choices[index]
                if tokens is END:
                    yield chunk(index, choice.finish(), choice.finish_reason)
                    continue
                piece = "".join(choice.push(t) for t in tokens if not choice.stopped)
                if choice.stopped:
                    streams.drop(index)
                    gens[index].abandon()
                    yield chunk(index, piece + choice.finish(), choice.finish_reason)
                else:  # empty while a character is incomplete: the client still sees its tokens arrive
                    yield chunk(index, piece)
            self._tally(gens[0].weights(), time.perf_counter() - started, ok=True)
            if options.include_usage:
                used = oa.usage(prompt_tokens, sum(len(r.tokens) for r in requests))
                yield _event(oa.body(id_, model, gens[0].weights(), [], chat, chunk=True, usage=used))
        except asyncio.TimeoutError:
            yield _event(oa.error_body(408, f"not answered within {self.config.request_timeout_s} s"))
        except (*SHARD_LOST, LostTwice):
            yield _event(oa.error_body(503, "the model's shards were lost twice under this request; retry"))
        except RuntimeError as err:
            self._tally(gens[0].weights() if gens else self.fingerprint, 0.0, ok=False)
            yield _event(oa.error_body(500, f"this request could not be decoded: {err}"))
        finally:  # finished, timed out or disconnected: either way its decoders stop computing it
            if streams is not None:
                streams.close()
            for gen in gens:
                gen.abandon()
            self.choices.give_back(len(requests))
        yield _event("[DONE]")

    def _generate(self, request: Completion) -> Generation:
        if self.engine is not None:
            seq = self.engine.submit(request)
            engine = self.engine
            return Generation(request, engine.tokens(seq), lambda: setattr(seq, "abandoned", True),
                              lambda: seq.weights or engine.weights)
        ticket = Ticket(request, time.perf_counter())
        return Generation(request, self._decode(ticket), lambda: setattr(ticket, "abandoned", True),
                          lambda: ticket.weights or self.fingerprint)

    @api.post("/v1/predict")
    async def predict(self, body: PredictRequest) -> dict[str, Any]:
        self._expect(generates=False)
        bad = [i for i, row in enumerate(body.inputs) if len(row) != self.in_dim]
        if bad:
            raise ClientError(422, f"each input needs {self.in_dim} values; row {bad[0]} has "
                                   f"{len(body.inputs[bad[0]])}", "inputs")
        with torch.no_grad():
            outputs = self.mlp(torch.tensor(body.inputs))
        return {"outputs": outputs.tolist()}

    @api.get("/healthz")
    async def healthz(self) -> Response:
        if not self.generates or self.model is None or await asyncio.to_thread(self.model.healthy):
            engine = None if not self.generates else "vllm" if isinstance(self.engine, VllmEngine) else "builtin"
            return JSONResponse({"status": "ok", "model": self.kind, "engine": engine})
        return error_response(503, "a model shard is not answering; the shard group is being rebuilt")

    @api.get("/metrics")
    async def metrics_text(self) -> Response:
        """Every replica's series (and Serve's own), from every node's metrics export endpoint:
        scraped at most once per SCRAPE_REUSE_S however often it is asked for (the agents export
        every few seconds anyway), so a client polling it cannot make the replica scrape the cluster
        in a loop."""
        async with self._scrape_lock:
            taken, text = self._scrape
            if time.monotonic() - taken > SCRAPE_REUSE_S:
                self._scrape = (time.monotonic(), await asyncio.to_thread(scrape_cluster))
            return Response(self._scrape[1], media_type="text/plain; version=0.0.4")

    def publish_metrics(self) -> None:
        """Start (once, on the replica's event loop, from a request's guard or Serve's health
        check, whichever comes first) the task that keeps the gauges current and, serving a run
        with `follow`, the one that follows it."""
        loop = asyncio.get_running_loop()
        if self._publisher is None:
            self._publisher = loop.create_task(self._publish())
        if self.config.follow and self._follower is None:
            self._follower = loop.create_task(self._follow())

    async def _follow(self) -> None:
        """Serves each checkpoint the run commits after the served one (and after any an operator
        passed over with /admin/rollback or /admin/promote). A checkpoint that is refused is
        never tried again; one that cannot be read now is tried again. With a canary, the app's
        Rollout says whether this replica serves it now (a canary), waits, serves it (promoted),
        or refuses it (a canary then steps back)."""
        while True:
            await asyncio.sleep(self.config.follow_interval_s)
            view: View = await self.app_weights.look.remote(self.replica, self.fingerprint)
            for step, reason in view.refused.items():  # refused on another replica: not tried here
                self.refused.setdefault(step, reason)
            if await self._apply_pin(view.pin):
                continue
            candidate = await self._next_candidate(view)
            if candidate is None:
                continue
            source, step, made_at = candidate
            role = PROMOTE if self.rollout is None else await self.rollout.role.remote(
                self.replica, step, f"{self.run_name}@{step}", self.fingerprint)
            if role.startswith(REFUSE):
                await self._refused_by_canary(step, role.removeprefix(REFUSE))
                continue
            if role == PROMOTE and self.served_step == step:  # a canary's checkpoint, promoted everywhere
                self.follow_after = step
                await self.app_weights.promote.remote(self.served[-1])
            if role == WAIT or self.served_step == step:
                continue
            try:
                await self._serve_checkpoint(source)
            except (WeightsRefused, BadCheckpoint) as err:
                print(f"shardyard: {err}: not served; {self.fingerprint} still is", flush=True)
                await self.app_weights.refuse.remote(step, str(err))
                if self.rollout is not None:
                    await self.rollout.refuse.remote(step, str(err))
                continue
            except ray.exceptions.ObjectLostError:  # its publisher (training's rank 0) is gone
                self.unreachable.add(step)
                print(f"shardyard: the weights published at {source} are gone; the run's checkpoint of that "
                      f"step serves once it is committed", flush=True)
                continue
            except Exception as err:  # noqa: BLE001 - the served weights stay; tried again next time
                print(f"shardyard: could not swap in {source} ({type(err).__name__}: {err}); "
                      f"{self.fingerprint} still serves", flush=True)
                continue
            if role == PROMOTE:
                self.follow_after = step
                await self.app_weights.promote.remote(source)
            if made_at is not None:
                self.metrics.commit_to_serving.set(time.time() - made_at)

    async def _apply_pin(self, pin: Pin | None) -> bool:
        """Serve an operator's pin this replica has not applied yet (True: one was there). Its
        weights were judged by the replica the operator's call reached: here they are only read
        (and checked finite). One that cannot be read now is tried again at the next look."""
        if pin is None or pin.serial <= self.pin_applied:
            return False
        self.follow_after = max(self.follow_after, pin.follow_after)
        try:
            if pin.step != self.served_step:
                await self._serve_checkpoint(pin.source, operator=True, judged=True)
        except (WeightsRefused, BadCheckpoint, ray.exceptions.ObjectLostError) as err:
            print(f"shardyard: the operator's choice of step {pin.step} cannot serve here ({err}); "
                  f"{self.fingerprint} still serves", flush=True)
        except Exception as err:  # noqa: BLE001 - the served weights stay; tried again next time
            print(f"shardyard: could not swap in the operator's choice of step {pin.step} "
                  f"({type(err).__name__}: {err}); {self.fingerprint} still serves", flush=True)
            return True
        self.pin_applied = pin.serial
        return True

    async def _next_candidate(self, view: View) -> tuple[Source, int, float | None] | None:
        """The newest weights of the run not served yet (nor refused, nor passed over): its newest
        committed checkpoint or the weights it published last, whichever is newer (at the same
        step, the published ones: no storage read); with their step and when they were made."""
        options = []
        found = await asyncio.to_thread(self._newest_committed)
        if found is not None:
            options.append((step_of(found[0].name), 0, found[0], found[1].get("time")))
        published = view.published
        if published is not None and published.run == self.run_name and published.step not in self.unreachable:
            options.append((published.step, 1, published, published.time))
        options = [o for o in options if o[0] > self.follow_after and o[0] not in self.refused]
        if not options:
            return None
        step, _, source, made_at = max(options)
        return source, step, made_at

    async def _refused_by_canary(self, step: int, reason: str) -> None:
        """The canary's verdict: nobody serves `step`; a replica that served it as a canary
        returns to the weights it served before."""
        self.refused[step] = f"canary: {reason}"
        self.metrics.promotions_refused.inc()
        print(f"shardyard: step {step} refused after its canary: {reason}", flush=True)
        if self.served_step == step and len(self.served) > 1:
            await self._serve_checkpoint(self.served[-2], operator=True)

    def _newest_committed(self) -> tuple[Path, dict[str, Any]] | None:
        """The run's newest checkpoint with a valid commit record, and the record. Its files are
        verified once, when a candidate is read (prepare), not on every look at the run."""
        found = newest_good(RunStorage(self.config.source), check_files=False)
        return (Path(self.config.source).expanduser().absolute() / found[0], found[1]) if found else None

    async def _serve_checkpoint(self, checkpoint: Source, operator: bool = False, judged: bool = False) -> None:
        """The gate, then the swap: a validation loss worse than the served one's (as the run
        logged them; not for an operator's own choice), weights that are not finite (a diverged
        run), read by each shard beside the serving weights, or golden prompts answered otherwise
        than they must be (judged once swapped in, before any client's request) are counted,
        listed in /v1/models and refused (WeightsRefused); the others are swapped in between
        iterations (the engine's swap_weights). `judged`: an operator's choice another replica's
        golden prompts let through (they are not asked again here). One at a time: the follower
        and the admin routes share it."""
        async with self._swapping:
            step = source_step(checkpoint)
            fingerprint = f"{self.run_name}@{step}"
            self.candidate_step = step
            try:
                worse = None if operator else await asyncio.to_thread(self._worse_validation, step)
                if worse:
                    raise WeightsRefused(f"{checkpoint}: {worse}")
                source = checkpoint if isinstance(checkpoint, Published) else str(checkpoint)
                # Weights served before passed the golden prompts then (a rollback, a canary stepping
                # back): judged against the ones they replace, they would fail for having answered first.
                golden = [] if judged or checkpoint in self.served else self.config.golden_prompts
                if isinstance(self.engine, VllmEngine):
                    await self._swap_vllm(checkpoint, source, fingerprint, golden)
                elif not await asyncio.to_thread(self.model.prepare, source):
                    self.model.drop_staged()
                    raise WeightsRefused(f"{checkpoint} has weights that are not finite")
                else:
                    await self._swap_between_passes(lambda: self._swap_in(checkpoint, fingerprint, golden))
            except (WeightsRefused, BadCheckpoint) as err:  # a file that does not match its record too
                self.refused[step] = str(err)
                self.metrics.promotions_refused.inc()
                raise
            finally:
                self.candidate_step = None
            self.refused.pop(step, None)  # an operator's promotion of a step refused before
            self.served.append(checkpoint)
            self.metrics.promotions.inc()
            print(f"shardyard: serving {fingerprint}", flush=True)

    async def _swap_between_passes(self, apply: Callable[[], str]) -> None:
        """`apply` the swap where no request is mid-way: at an engine iteration boundary once the
        running requests are done, or between static batches."""
        if isinstance(self.engine, DecodingEngine):
            await self.engine.swap_weights(apply)
            return
        async with self._batches.exclusive():
            await asyncio.to_thread(apply)

    def _worse_validation(self, step: int) -> str | None:
        """Why the run's own validation loss keeps `step` from serving (None: it does not, or the
        run logged none to compare)."""
        tolerance = self.config.val_loss_tolerance
        if tolerance is None:
            return None
        rows = read_metrics(self.config.source)
        candidate, served = validation_loss_at(rows, step), validation_loss_at(rows, self.served_step or 0)
        if candidate is None or served is None or candidate <= served * (1 + tolerance):
            return None
        return (f"its validation loss {candidate:.4f} is worse than the served step {self.served_step}'s "
                f"{served:.4f} by more than {tolerance:.0%}")

    def _swap_in(self, checkpoint: Source, fingerprint: str, golden: list[GoldenPrompt]) -> str:
        """In the engine's drained window: the prepared weights serve from now on, once they
        answer the `golden` prompts as they must; else the served ones stay (WeightsRefused)."""
        with self.model.exclusive():  # the swap, the golden passes and a swap back on one shard group
            if golden and self._golden[0] != self.fingerprint:  # the served weights' answers, once
                self._golden = (self.fingerprint, self._golden_answers())
            self.model.swap()
            failed: list[str] | None = None  # None: the golden passes did not finish (a shard lost)
            try:
                answers = self._golden_answers() if golden else []
                failed = regressions(golden, self._golden[1], answers, self.config.golden_max_edit_distance)
            except SHARD_LOST:
                raise
            except RuntimeError as err:  # a golden prompt's token could not be chosen (NaN logits)
                failed = [f"a golden prompt could not be decoded ({err})"]
            finally:
                if failed != []:
                    self.model.swap_back()
                self.model.drop_staged()
        if failed:
            raise WeightsRefused(f"{checkpoint}: " + "; ".join(failed))
        if golden:
            self._golden = (fingerprint, answers)
        self.served_step, self.fingerprint = source_step(checkpoint), fingerprint
        return fingerprint

    def _golden_answers(self) -> list[str]:
        return greedy_answers(self.model.forward, self.config.golden_prompts, self.codec, self.block_size,
                              self.stop_token)

    async def _swap_vllm(self, checkpoint: Source, source: str | Published, fingerprint: str,
                         golden: list[GoldenPrompt]) -> None:
        """The gate and the swap where vLLM decodes: `source` written out as a model directory
        (refused when its weights are not finite), reloaded by vLLM in its drained window, where
        the `golden` prompts are decoded; the served weights are reloaded when they fail, or
        when the reload itself fails."""
        model_dir = await asyncio.to_thread(written_out, source, self.config.trust_factory)
        if model_dir is None:
            raise WeightsRefused(f"{checkpoint} has weights that are not finite")

        async def apply() -> str:
            if golden and self._golden[0] != self.fingerprint:  # the served weights' answers, once
                self._golden = (self.fingerprint, await self._vllm_golden_answers())
            try:
                await self.engine.load_weights(model_dir)
                answers = await self._vllm_golden_answers() if golden else []
                failed = regressions(golden, self._golden[1], answers, self.config.golden_max_edit_distance)
            except BaseException:
                await self.engine.load_weights(self.vllm_dir)
                raise
            if failed:
                await self.engine.load_weights(self.vllm_dir)
                raise WeightsRefused(f"{checkpoint}: " + "; ".join(failed))
            if golden:
                self._golden = (fingerprint, answers)
            self.served_step, self.fingerprint = source_step(checkpoint), fingerprint
            return fingerprint

        try:
            await self.engine.swap_weights(apply)
        except BaseException:
            shutil.rmtree(model_dir, ignore_errors=True)
            raise
        previous, self.vllm_dir = self.vllm_dir, model_dir
        if previous != self.config.checkpoint:  # written out by this replica (not a model directory given)
            shutil.rmtree(previous, ignore_errors=True)

    async def _vllm_golden_answers(self) -> list[str]:
        """The golden prompts' greedy answers, decoded by vLLM inside a swap's drained window."""
        requests = golden_requests(self.config.golden_prompts, self.codec, self.stop_token)
        for request in requests:
            async for _ in self.engine.tokens(self.engine.submit(request), gated=False):
                pass
        return answer_texts(requests, self.codec)

    @api.post("/admin/rollback")
    async def rollback(self) -> dict[str, Any]:
        """Back to the weights the app promoted before the current ones, on every replica; the
        followers then wait for a checkpoint committed after this call."""
        self._expect_admin()
        view: View = await self.app_weights.look.remote(self.replica, self.fingerprint)
        target = rollback_target(view.promoted, self.served_step, {**view.refused, **self.refused})
        if target is None:
            raise ClientError(409, "the app has served no earlier weights to go back to")
        if isinstance(target, Path) and committed_record(target) is None:
            raise ClientError(409, f"the earlier weights ({target.name}) are no longer in the run (pruned); "
                                   f"POST /admin/promote names a step it still holds")
        return await self._pin(target)

    @api.post("/admin/promote")
    async def promote(self, body: PromoteRequest) -> dict[str, Any]:
        """The run's checkpoint of `step`, through the same gate, on every replica; the followers
        then wait for a checkpoint committed after this call."""
        self._expect_admin()
        checkpoint = Path(self.config.source).expanduser().resolve() / checkpoint_name(body.step)
        if committed_record(checkpoint) is None:
            raise ClientError(404, f"the run has no committed checkpoint of step {body.step}", "step")
        return await self._pin(checkpoint)

    def _expect_admin(self) -> None:
        """The admin routes change what every client is answered with: only with the app's bearer
        token (the guard has checked it), and only on an app that follows a run."""
        if self.config.bearer_token is None:
            raise ClientError(403, "the admin routes need the app's bearer token (bearer_token_env or "
                                   "bearer_token_file)")
        if not self.config.follow:
            raise ClientError(409, "the admin routes act on an app that follows a run directory (follow: true)")

    async def _pin(self, checkpoint: Source) -> dict[str, Any]:
        """Serve `checkpoint` here through the gate, then pin it for the app: every replica serves
        it at its next look, and no follower serves a step the run had committed or published by
        now. Answers once every live replica serves it, or after PIN_WAIT_S with how many do."""
        newest = await asyncio.to_thread(self._newest_committed)
        published: Published | None = (await self.app_weights.look.remote(self.replica, self.fingerprint)).published
        follow_after = max(self.follow_after, step_of(newest[0].name) if newest else 0,
                           published.step if published is not None else 0)
        self.follow_after = follow_after
        try:
            await self._serve_checkpoint(checkpoint, operator=True)
        except (WeightsRefused, BadCheckpoint) as err:
            raise ClientError(422, f"{err}: {self.fingerprint} still serves", "step") from None
        except ray.exceptions.ObjectLostError:
            raise ClientError(409, f"the weights published at {checkpoint} are gone (the training worker that "
                                   f"held them exited); {self.fingerprint} still serves") from None
        pin: Pin = await self.app_weights.pin.remote(checkpoint, follow_after)
        self.pin_applied = max(self.pin_applied, pin.serial)
        await self.app_weights.look.remote(self.replica, self.fingerprint)  # its own weights: counted now
        deadline = time.monotonic() + PIN_WAIT_S
        while True:
            serving, live = await self.app_weights.serving_count.remote(self.fingerprint)
            if serving >= live or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        return {"served_step": self.served_step, "system_fingerprint": self.fingerprint,
                "replicas_serving": serving, "replicas": live}

    async def _publish(self) -> None:
        while True:
            if self.rollout is not None:  # what this replica's answers cost, for the canary's verdict
                tallies = {weights: replace(tally) for weights, tally in self.tally.items()}
                await self.rollout.report.remote(self.replica, self.fingerprint, tallies)
            self.metrics.served_step.set(-1 if self.served_step is None else self.served_step)
            if self.engine is not None:
                self.metrics.read_engine(self.engine.stats)
            elif self.generates:
                self.metrics.max_batch_size.set(self.batch_limit)
            await asyncio.sleep(PUBLISH_EVERY_S)

    def check_health(self) -> None:
        """Serve's periodic health check: a dead shard gets the whole group rebuilt; only a group
        that cannot be rebuilt fails the replica (Serve then replaces it)."""
        try:
            self.publish_metrics()
        except RuntimeError:  # called off the event loop: a request's guard starts them instead
            pass
        if self.generates and self.model is not None:  # vLLM's engine checks its own workers
            self._heal()

    # ------------------------------------------------------------------ static batching

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _decode(self, tickets: list[Ticket]) -> AsyncIterator[list[Any]]:
        """Decode a batch together. After every forward pass, yield for each ticket its new token,
        or StopIteration once it has all of them or nobody waits for it any more."""
        async with self._batches.shared():  # a weight swap waits for this batch to end
            async for tokens in self._decode_batch(tickets):
                yield tokens

    async def _decode_batch(self, tickets: list[Ticket]) -> AsyncIterator[list[Any]]:
        started = time.perf_counter()
        live = [t for t in tickets if not t.abandoned]  # gone before their batch ran: dropped
        self.metrics.batch_started([started - ticket.arrived for ticket in live])
        for ticket in tickets:
            ticket.weights = self.fingerprint
        requests = [t.request for t in tickets]
        steps = 0
        for attempt in range(2):  # a shard lost mid-batch: rebuild the group and resume, once
            group = self.model.rebuilds
            decoding = decode_steps(self.model.forward, requests, self.block_size, lambda row: tickets[row].abandoned)
            try:
                while (rows := await asyncio.to_thread(next, decoding, None)) is not None:
                    steps += 1
                    self.metrics.tokens.inc(len(rows))
                    got = set(rows)
                    yield [requests[i].tokens[-1] if i in got else StopIteration for i in range(len(tickets))]
                break
            except SHARD_LOST:
                if attempt:
                    raise
                await asyncio.to_thread(self._rebuild, group)
        elapsed = time.perf_counter() - started
        self.metrics.batch_finished(elapsed)
        if self.adaptive and steps and self.adaptive.observe(len(live), elapsed / steps):
            self._decode.set_max_batch_size(self.adaptive.size)
            self.batch_limit = self.adaptive.size

    def _rebuild(self, failed: int) -> None:
        if self.model.rebuild(failed):
            self.metrics.rebuilds.inc()

    def _heal(self, rebuild_if_slow: bool = False) -> None:
        """A group with a dead shard is rebuilt (one being rebuilt, or already replaced, is kept):
        Serve's health check, and the engine's call after a forward pass failed (then a shard
        that does not answer counts as lost too)."""
        if self.model.heal(rebuild_if_slow):
            self.metrics.rebuilds.inc()

    def _expect(self, generates: bool, model: str | None = None) -> None:
        if self.generates != generates:
            route = "/v1/completions" if self.generates else "/v1/predict"
            raise ClientError(404, f"this app serves a '{self.kind}' model: use {route}")
        if model is not None and model != self.config.model_id:
            raise ClientError(404, f"the model '{model}' is not served here; this app serves "
                                   f"'{self.config.model_id}' (GET /v1/models)", "model", "model_not_found")


def _describe(bundle: dict[str, float]) -> str:
    return f"{bundle['CPU']:g} CPU" + (" and 1 GPU" if bundle.get("GPU") else "")


def _check_room(bundles: list[dict[str, float]], cfg: Any, what: str) -> None:
    """A replica no node can hold would leave the app waiting forever: refuse it before."""
    try:
        check_room(bundles, cfg.multi_node, what)
    except ValueError as err:
        raise SpecError(f"invalid serve config: {err}") from None


def build_app(args: dict[str, Any]) -> "serve.Application":
    """The Serve application for `args` (ServeConfig keys), validated before anything starts."""
    cfg = parse_config(args)
    generates = isinstance(read_spec(cfg.checkpoint).model, LANGUAGE_MODELS)
    options: dict[str, Any] = dict(
        max_ongoing_requests=cfg.concurrency,
        max_queued_requests=cfg.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": REPLICA_CPUS},
    )
    if cfg.max_replicas is None:
        options["num_replicas"] = cfg.num_replicas
    else:  # scale on requests in flight: a replica is busy at one full batch
        options["autoscaling_config"] = {"min_replicas": cfg.num_replicas, "max_replicas": cfg.max_replicas,
                                         "target_ongoing_requests": cfg.max_batch_size}
    if generates and cfg.num_shards == 1:  # the model in the replica: the replica holds its shard's bundle
        bundle = shard_bundle(cfg.use_gpu, REPLICA_CPUS + cfg.cpus_per_shard)
        _check_room([bundle], cfg, f"a replica decoding in its own process ({_describe(bundle)})")
        options["ray_actor_options"] = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0.0)}
    elif generates:  # the replica's own bundle, then one per shard: Serve reserves them together
        bundles = [{"CPU": REPLICA_CPUS}] + [shard_bundle(cfg.use_gpu, cfg.cpus_per_shard)] * cfg.num_shards
        _check_room(bundles, cfg, f"a replica (its {REPLICA_CPUS} CPU and {cfg.num_shards} shards of "
                                  f"{_describe(bundles[1])})")
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = "PACK" if cfg.multi_node else "STRICT_PACK"
    if cfg.engine == "vllm":
        options["ray_actor_options"]["runtime_env"] = SERVING_PRIORITY
    # The checkpoint as given: a replica started later (autoscaling, a replacement) loads the
    # run's newest committed checkpoint then, or, following the run, the weights the app serves.
    rollout = None if cfg.canary is None else Rollout.bind(cfg.canary)
    app_weights = AppWeights.bind() if cfg.follow else None
    return ModelServer.options(**options).bind({**cfg.model_dump(), "checkpoint": cfg.source}, rollout, app_weights)
