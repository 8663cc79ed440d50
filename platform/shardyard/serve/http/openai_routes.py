"""The HTTP surface clients use: OpenAI's routes (serve/http/openai_api.py), so that its clients and
tools work unchanged, and the replica's own health and metrics.

    POST /v1/completions       prompt (a string or a list), n, max_tokens, stop, seed, stream,
                               logprobs, and sampling: OpenAI's fields and vLLM's extensions
                               (serve/http/openai_api.py, serve/sampling.py)  -> text_completion
    POST /v1/chat/completions  messages (the tokenizer's chat template, or a plain one) -> chat.completion
    GET  /v1/models            the served model's id (a request naming another gets 404), its step
    POST /v1/predict           {"inputs": [[float, ...], ...]}        (MLP checkpoints)
    GET  /healthz              200 while every part of the engine answers
    GET  /metrics              Prometheus text: latency, queue time, tokens, engine state

The routes are FastAPI functions on `router`; what they answer from is the replica's `Answering`
(`app.state.answering`, set as the replica starts). Requests become choices here (prompt length,
max_tokens, n, logit_bias checked), their tokens come from the engine backend (serve/engine/backend.py),
and their text goes back whole or streamed (`stream: true`: each choice's text as it is decoded,
several choices interleaved, as `data: {chunk}` lines ending with `data: [DONE]`). Every refusal is
a ClientError, answered in OpenAI's error shape by the guard (serve/http/guard.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from pydantic import BaseModel, ConfigDict, Field

from shardyard.checkpoint.published import Published
from shardyard.storage.store import DIR_PREFIX
from shardyard.serve.http import openai_api as oa
from shardyard.serve.engine.backend import EngineBackend, EngineCoreLost, Generation
from shardyard.serve.http.choices import ChoiceText
from shardyard.serve.resolved import ResolvedConfig
from shardyard.serve.generation import Completion
from shardyard.serve.http.guard import ChoiceLimit, ClientError, Held, error_response
from shardyard.serve.follow.rollout import Tally
from shardyard.serve.engine.scheduler import LostTwice
from shardyard.serve.executor.shards import SHARD_LOST
from shardyard.serve.http.streams import END, Interleaved
from shardyard.serve.follow.gate import Served

# How long one scrape of the cluster's metrics answers GET /metrics.
SCRAPE_REUSE_S = 2.0


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: list[list[Annotated[float, Field(allow_inf_nan=False)]]] = Field(min_length=1)  # JSON allows NaN


@dataclass
class Answering:
    """What the routes answer from: the config, the model's kind and context, the engine backend
    (None for the MLP, answered by `mlp`), what serves, and the replica's counts."""
    cfg: ResolvedConfig
    kind: str  # the model's spec name
    context: int  # tokens a language model sees at most (0: the MLP)
    vocabulary: int
    engine: EngineBackend | None
    served: Served
    scrape: Callable[[], str]  # this app's series from every node's metrics export
    mlp: torch.nn.Module | None = None
    in_dim: int = 0
    started: int = field(default_factory=lambda: int(time.time()))
    tally: dict[str, Tally] = field(default_factory=dict)  # requests answered, by the weights that answered them

    def __post_init__(self) -> None:
        self.choices = ChoiceLimit(self.cfg.concurrency, self.cfg.limits.max_queued_requests, self.cfg.limits.request_timeout_s)
        self.codec, self.stop_token = self.cfg.codec, self.cfg.stop_token
        self._scrape, self._scrape_lock = (float("-inf"), ""), asyncio.Lock()

    @property
    def generates(self) -> bool:
        return self.engine is not None

    def record(self, weights: str, seconds: float, ok: bool) -> None:
        self.tally.setdefault(weights, Tally()).record(seconds, ok)

    def expect(self, generates: bool, model: str | None = None) -> None:
        if self.generates != generates:
            route = "/v1/completions" if self.generates else "/v1/predict"
            raise ClientError(404, f"this app serves a '{self.kind}' model: use {route}")
        if model is not None and model != self.cfg.model_id:
            raise ClientError(404, f"the model '{model}' is not served here; this app serves "
                                   f"'{self.cfg.model_id}' (GET /v1/models)", "model", "model_not_found")

    def prompt_tokens(self, text: str, max_tokens: int, field: str = "prompt") -> list[int]:
        cfg = self.cfg
        if len(text) > cfg.limits.max_prompt_chars:
            raise ClientError(400, f"{field} is {len(text)} characters; the limit is {cfg.limits.max_prompt_chars}", field)
        if max_tokens > cfg.limits.max_tokens_limit:
            raise ClientError(400, f"max_tokens may be at most {cfg.limits.max_tokens_limit}", "max_tokens")
        tokens = self.codec.encode(text)
        if not tokens:
            raise ClientError(400, f"{field} encodes to no tokens", field)
        if self.engine.bounded and len(tokens) + max_tokens > self.context:
            room = self.context - len(tokens)
            fits = f"at most {room} new tokens fit after this prompt" if room > 0 else "the prompt alone fills it"
            raise ClientError(400, f"the prompt's {len(tokens)} tokens plus max_tokens {max_tokens} exceed "
                                   f"the model's context of {self.context} tokens: {fits}", field,
                              "context_length_exceeded")
        return tokens

    def completions(self, prompts: list[list[int]], body: oa.CompletionRequest | oa.ChatRequest) -> list[Completion]:
        """A choice per prompt and per `n`, in OpenAI's order (prompt by prompt); choice j of a
        seeded request draws from seed + j (oa.choice_seed), so its n choices differ and each is
        reproducible."""
        count, limit = len(prompts) * body.n, self.cfg.limits.max_choices_per_request
        if count > limit:
            raise ClientError(400, f"{len(prompts)} prompt(s) x n {body.n} = {count} choices; a request may ask "
                                   f"for at most {limit}", "n" if body.n > 1 else "prompt")
        if body.logit_bias and max(body.logit_bias) >= self.vocabulary:
            raise ClientError(400, f"logit_bias names token {max(body.logit_bias)}; the vocabulary has "
                                   f"{self.vocabulary}", "logit_bias")
        sampling = body.sampling()
        return [Completion(p, body.new_tokens, sampling, oa.choice_seed(body.seed, j), self.stop_token)
                for p in prompts for j in range(body.n)]

    async def metrics_text(self) -> str:
        """Scraped at most once per SCRAPE_REUSE_S however often it is asked for (the agents export
        every few seconds anyway), so a client polling it cannot make the replica scrape the cluster
        in a loop."""
        async with self._scrape_lock:
            if time.monotonic() - self._scrape[0] > SCRAPE_REUSE_S:
                self._scrape = (time.monotonic(), await asyncio.to_thread(self.scrape))
            return self._scrape[1]


def answering(request: Request) -> Answering:
    return request.app.state.answering


Replica = Annotated[Answering, Depends(answering)]
router = APIRouter()


@router.post("/v1/completions")
async def completions(body: oa.CompletionRequest, a: Replica) -> Any:
    a.expect(generates=True, model=body.model)
    prompts = [a.prompt_tokens(p, body.new_tokens) for p in body.prompt]
    return await answer(a, prompts, body, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: oa.ChatRequest, a: Replica) -> Any:
    a.expect(generates=True, model=body.model)
    prompt = oa.render_chat(body.messages, a.cfg.tokenizer)
    return await answer(a, [a.prompt_tokens(prompt, body.new_tokens, "messages")], body, chat=True)


@router.get("/v1/models")
async def models(a: Replica) -> dict[str, Any]:
    served = a.served
    return {"object": "list", "data": [{"id": a.cfg.model_id, "object": "model", "created": a.started,
                                        "owned_by": "shardyard", "max_model_len": a.context or None,
                                        "served_step": served.step, "candidate_step": served.candidate_step,
                                        "refused_steps": {str(k): without_paths(v) for k, v in served.refused.items()},
                                        "served_from": ("object store" if isinstance(served.sources[-1], Published)
                                                        else "storage"),
                                        "system_fingerprint": served.fingerprint}]}


# A path or URI in a refusal's reason: from a word's start, up to white space, a quote or punctuation.
_LOCATION = re.compile(r"(?<![\w.])(?:[a-z][a-z0-9+.-]*://|/)[^\s'\"(),;]+")


def without_paths(reason: str) -> str:
    """A refusal's reason as clients may read it: each path on the server cut to what it names in
    the run (from the checkpoint's directory on), or to its last part. The whole reason stays in
    the replica's log."""
    def short(found: re.Match[str]) -> str:
        location = found.group(0)
        at = location.find(DIR_PREFIX)
        return location[at:] if at >= 0 else location.rstrip("/").rsplit("/", 1)[-1]
    return _LOCATION.sub(short, reason)


@router.post("/v1/predict")
async def predict(body: PredictRequest, a: Replica) -> dict[str, Any]:
    a.expect(generates=False)
    bad = [i for i, row in enumerate(body.inputs) if len(row) != a.in_dim]
    if bad:
        raise ClientError(400, f"each input needs {a.in_dim} values; row {bad[0]} has {len(body.inputs[bad[0]])}",
                          "inputs")
    with torch.no_grad():
        outputs = a.mlp(torch.tensor(body.inputs))
    return {"outputs": outputs.tolist()}


@router.get("/healthz")
async def healthz(a: Replica) -> Response:
    if a.engine is None or await a.engine.health():
        return JSONResponse({"status": "ok", "model": a.kind, "engine": a.engine and a.engine.name})
    return error_response(503, "a model shard is not answering; the shard group is being rebuilt")


@router.get("/metrics")
async def metrics_text(a: Replica) -> Response:
    """This app's series, every replica's (and Serve's own for the app), from every node's export."""
    return Response(await a.metrics_text(), media_type="text/plain; version=0.0.4")


def _event(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def answer(a: Answering, prompts: list[list[int]], body: oa.CompletionRequest | oa.ChatRequest,
                  chat: bool) -> Any:
    id_ = oa.completion_id(chat)
    requests = a.completions(prompts, body)
    prompt_tokens = sum(len(p) for p in prompts)
    arrived = time.perf_counter()  # its time to first token counts the wait for a place among the choices
    held = await a.choices.take(len(requests))
    for request in requests:
        request.arrived = arrived
    if body.stream:
        options = body.stream_options or oa.StreamOptions()
        return HeldStream(_stream(a, requests, body.stop, chat, id_, options, prompt_tokens), held)
    gens: list[Generation] = []
    started = time.perf_counter()
    try:
        gens = [a.engine.generate(r) for r in requests]
        choices = [ChoiceText(r, a.codec, body.stop, chat) for r in requests]
        # Awaited here, not through wait_for: a disconnect's cancellation ends the gather in this
        # task, which takes its CancelledError (wait_for left it unretrieved: a traceback in the
        # replica's log for every client that stopped waiting).
        async with asyncio.timeout(a.cfg.limits.request_timeout_s):
            await asyncio.gather(*(_collect(g, c) for g, c in zip(gens, choices)))
    except asyncio.TimeoutError:
        raise ClientError(408, f"not answered within {a.cfg.limits.request_timeout_s} s") from None
    except (*SHARD_LOST, LostTwice):
        raise ClientError(503, "the model's shards were lost twice under this request; retry") from None
    except EngineCoreLost as err:
        raise ClientError(503, str(err)) from None
    except RuntimeError as err:  # this request alone failed (the others in its steps go on)
        a.record(gens[0].weights() if gens else a.served.fingerprint, 0.0, ok=False)
        raise ClientError(500, f"this request could not be decoded: {err}") from None
    finally:  # answered, timed out or disconnected: its decoder stops computing it
        for gen in gens:
            gen.abandon()
        held.give_back()
    out = [oa.choice(i, c.text(), c.finish_reason, chat, logprobs=c.logprobs()) for i, c in enumerate(choices)]
    used = oa.usage(prompt_tokens, sum(len(r.tokens) for r in requests))
    a.record(gens[0].weights(), time.perf_counter() - started, ok=True)
    return oa.body(id_, a.cfg.model_id, gens[0].weights(), out, chat, usage=used)


class HeldStream(StreamingResponse):
    """A stream whose request's choices count against the replica's limit until its response
    ends, however it ends: sent whole, its client gone (Serve cancels the request's task, and
    Starlette then never runs a background task), timed out, or never sent at all (cancelled
    between the route's return and the response's start: the finalizer gives the share back)."""

    def __init__(self, content: AsyncIterator[str], held: Held) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._held = held
        weakref.finalize(self, held.give_back)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # also on CancelledError, which is how a disconnect reaches this task
            self._held.give_back()
            # A stream cancelled while suspended at a chunk is closed here, so its decoders stop
            # (its own `finally` abandons them); closing a finished one does nothing.
            await self.body_iterator.aclose()


async def _collect(gen: Generation, choice: ChoiceText) -> None:
    """A choice's whole text, cut at a stop string."""
    async for token in gen.tokens:
        choice.push(token)
        if choice.stopped:
            gen.abandon()
            return
    choice.finish()


async def _stream(a: Answering, requests: list[Completion], stops: list[str], chat: bool, id_: str,
                  options: oa.StreamOptions, prompt_tokens: int) -> AsyncIterator[str]:
    """OpenAI's stream: chunks of text per choice as it is decoded (a chunk carries every token a
    choice got since its last one), each choice's last with its finish_reason, then (if asked) one
    with the usage, then [DONE]. A character split over several tokens appears with its last one
    (the chunks of the tokens before carry no text, as vLLM's do: sending none made a held-back
    character look like a stall to clients that time each chunk), and nothing of a stop string is
    sent."""
    started = time.perf_counter()
    model, deadline = a.cfg.model_id, started + a.cfg.limits.request_timeout_s
    choices = [ChoiceText(r, a.codec, stops, chat) for r in requests]

    def chunk(index: int, piece: str, reason: str | None = None, first: bool = False) -> str:
        used = None
        if options.continuous_usage_stats:
            used = oa.usage(prompt_tokens, sum(len(r.tokens) for r in requests))
        piece_choice = oa.choice(index, piece, reason, chat, delta=True, first=first,
                                 logprobs=choices[index].logprobs())
        return _event(oa.body(id_, model, gens[index].weights(), [piece_choice], chat, chunk=True, usage=used))
    gens: list[Generation] = []
    streams: Interleaved | None = None
    try:
        gens = [a.engine.generate(r) for r in requests]
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
        # Timed to the engine's last token: a client cannot sway the canary by how it reads.
        a.record(gens[0].weights(), streams.decoded_at() - started, ok=True)
        if options.include_usage:
            used = oa.usage(prompt_tokens, sum(len(r.tokens) for r in requests))
            yield _event(oa.body(id_, model, gens[0].weights(), [], chat, chunk=True, usage=used))
    except asyncio.TimeoutError:
        yield _event(oa.error_body(408, f"not answered within {a.cfg.limits.request_timeout_s} s"))
    except (*SHARD_LOST, LostTwice):
        yield _event(oa.error_body(503, "the model's shards were lost twice under this request; retry"))
    except EngineCoreLost as err:
        yield _event(oa.error_body(503, str(err)))
    except RuntimeError as err:
        a.record(gens[0].weights() if gens else a.served.fingerprint, 0.0, ok=False)
        yield _event(oa.error_body(500, f"this request could not be decoded: {err}"))
    finally:  # finished, timed out or disconnected: either way its decoders stop computing it
        if streams is not None:
            streams.close()
        for gen in gens:
            gen.abandon()
    yield _event("[DONE]")
