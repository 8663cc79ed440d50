"""The HTTP app: a Ray Serve deployment (FastAPI ingress) over a model trained by shardyard.

    POST /v1/completions  {"prompt": str, "max_tokens": int, "temperature": float, "seed": int,
                           "stream": bool}  (stream: server-sent events, one per token)
    POST /v1/predict      {"inputs": [[float, ...], ...]}        (MLP checkpoints)
    GET  /healthz         200 while every shard answers
    GET  /metrics         Prometheus text: latency, queue time, batch size, rejections, tokens

Concurrent completions are grouped by `@serve.batch` and decoded together (ragged prompts
left-padded and masked, so each answer equals the unbatched one); the batch handler yields a token
per request after every forward pass, which is what streaming sends. Batch size and wait are fixed
or adaptive (serve/batching.py). A shard lost under a batch gets the shard group rebuilt and the
batch resumed where it stopped. Every mistake a client can make
gets a 4xx with a reason: malformed JSON 400, bad or missing credentials 401, body too large 413,
invalid fields 422 (naming the field), too slow 408; a full queue is answered 503 with
Retry-After by Serve itself (`max_queued_requests`).
"""


import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.config import BackpressureConfig

from shardyard.serve.batching import AdaptiveBatchSize, calibrate
from shardyard.serve.config import ServeConfig, parse_config
from shardyard.serve.generation import Completion, TextCodec, TextStream, decode_steps
from shardyard.serve.shards import SHARD_LOST, ShardedModel, check_room, shard_bundle
from shardyard.spec import LANGUAGE_MODELS, SpecError
from shardyard.train.checkpoint import load_model, read_spec

api = FastAPI(title="shardyard")


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # the range torch's generator takes
    stream: bool = False


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: list[list[Annotated[float, Field(allow_inf_nan=False)]]] = Field(min_length=1)  # JSON allows NaN


@dataclass
class Ticket:
    """One completion waiting in (or running in) a batch."""
    request: Completion
    arrived: float
    abandoned: bool = False  # its caller stopped waiting (timeout, disconnect)


class ClientError(Exception):
    def __init__(self, status: int, reason: str, field: str | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.field = status, reason, field


def _error(status: int, reason: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": reason, **extra}, status_code=status)


def _event(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


@api.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e["type"] == "json_invalid" for e in errors):
        return _error(400, "request body is not valid JSON")
    fields = [{"field": ".".join(str(p) for p in e["loc"] if p != "body") or "body", "message": e["msg"]}
              for e in errors]
    return _error(422, "; ".join(f"{f['field']}: {f['message']}" for f in fields), fields=fields)


@api.exception_handler(ClientError)
async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
    return _error(exc.status, exc.reason, **({"fields": [{"field": exc.field, "message": exc.reason}]}
                                            if exc.field else {}))


class Metrics:
    """Per replica, in Prometheus' text format at /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("shardyard_request_latency_seconds", "request latency", ["route", "status"],
                                 registry=self.registry)
        self.queue = Histogram("shardyard_queue_seconds", "arrival to batch start", registry=self.registry)
        self.compute = Histogram("shardyard_batch_compute_seconds", "one batch's model time",
                                 registry=self.registry)
        self.batch_size = Histogram("shardyard_batch_size", "requests per batch", registry=self.registry,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.rejected = Counter("shardyard_rejected_total", "requests refused", ["reason"], registry=self.registry)
        self.tokens = Counter("shardyard_generated_tokens_total", "tokens generated", registry=self.registry)
        self.rebuilds = Counter("shardyard_shard_group_rebuilds_total", "shard groups rebuilt",
                                registry=self.registry)
        self.max_batch_size = Gauge("shardyard_max_batch_size", "the batch size limit now in force",
                                    registry=self.registry)


# The replica decodes and batches; its shards compute. Its bundle is small so that README's
# default app (2 shards of 0.75) fits a 2-core machine.
REPLICA_CPUS = 0.5
REJECT_REASONS = {400: "malformed_json", 401: "unauthorized", 404: "wrong_model", 408: "timeout",
                  413: "body_too_large", 422: "invalid_field", 503: "unavailable"}


@api.middleware("http")
async def _limits_and_metrics(request: Request, call_next) -> Response:
    server = request.app.state.server  # the replica (ModelServer) serving this process
    cfg, start = server.config, time.perf_counter()
    response = _check_request(request, cfg, await request.body())
    if response is None:
        response = await call_next(request)
    server.metrics.latency.labels(_route_label(request), str(response.status_code)).observe(time.perf_counter() - start)
    if response.status_code in REJECT_REASONS:
        server.metrics.rejected.labels(REJECT_REASONS[response.status_code]).inc()
    return response


def _route_label(request: Request) -> str:
    """The app's route a request went to (FastAPI records it in the request scope once matched),
    or "unmatched": labels come from a fixed set, so random paths cannot grow the metrics."""
    return getattr(request.scope.get("route"), "path", None) or "unmatched"


def _check_request(request: Request, cfg: ServeConfig, body: bytes) -> Response | None:
    if request.method != "POST":
        return None
    given = request.headers.get("authorization", "").encode()
    if cfg.bearer_token and not hmac.compare_digest(given, f"Bearer {cfg.bearer_token}".encode()):  # constant time
        return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
    if len(body) > cfg.max_body_bytes:
        return _error(413, f"request body is {len(body)} bytes; the limit is {cfg.max_body_bytes}")
    return None


# Everything ModelServer uses must be defined above it: Serve pickles the class when it is decorated.
@serve.deployment
@serve.ingress(api)
class ModelServer:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = parse_config(config)
        api.state.server = self
        self.metrics = Metrics()
        model_spec = read_spec(self.config.checkpoint).model
        self.kind = model_spec.name
        self.generates = isinstance(model_spec, LANGUAGE_MODELS)  # else the MLP regressor
        self.adaptive: AdaptiveBatchSize | None = None
        if self.generates:
            self.codec = TextCodec(self._tokenizer(model_spec))
            self.block_size = model_spec.block_size
            self._start_model()
        else:  # the MLP: small, served whole by the replica
            self.mlp = load_model(self.config.checkpoint).eval()
            self.in_dim = model_spec.in_dim

    @staticmethod
    def _tokenizer(model_spec: Any) -> Any:
        """The tokenizer a Hugging Face model directory brings; None: UTF-8 bytes are the tokens."""
        if not getattr(model_spec, "brings_tokenizer", False):
            return None
        from shardyard.models.hf import load_tokenizer

        return load_tokenizer(model_spec)

    def _shards(self, use_gpu: bool) -> ShardedModel:
        cfg = self.config
        return ShardedModel(cfg.checkpoint, cfg.num_shards, use_gpu, cfg.multi_node, cfg.sharding,
                            cpus_per_shard=cfg.cpus_per_shard)

    def _start_model(self) -> None:
        """Start the shard group, and set the batch size and wait: from the config, or measured
        on each candidate device (adaptive), keeping the device that decodes fastest in time."""
        cfg = self.config
        if cfg.batching != "adaptive":
            self.model = self._shards(cfg.use_gpu)
            if cfg.batching == "none":
                self._set_batching(1, 0.0)
            else:
                self._set_batching(cfg.max_batch_size, cfg.batch_wait_timeout_s)
            return
        target = cfg.token_latency_target_ms / 1000
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

    def _set_batching(self, max_batch_size: int, wait_timeout_s: float) -> None:
        self._decode.set_max_batch_size(max_batch_size)
        self._decode.set_batch_wait_timeout_s(wait_timeout_s)
        self.metrics.max_batch_size.set(max_batch_size)

    # ------------------------------------------------------------------ routes

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> dict[str, Any]:
        self._expect(generates=True)
        cfg = self.config
        if len(body.prompt) > cfg.max_prompt_chars:
            raise ClientError(422, f"prompt is {len(body.prompt)} characters; the limit is "
                                   f"{cfg.max_prompt_chars}", "prompt")
        if body.max_tokens > cfg.max_tokens_limit:
            raise ClientError(422, f"max_tokens may be at most {cfg.max_tokens_limit}", "max_tokens")
        ticket = Ticket(Completion(self.codec.encode(body.prompt), body.max_tokens, body.temperature, body.seed),
                        time.perf_counter())
        if body.stream:
            return StreamingResponse(self._events(ticket), media_type="text/event-stream")

        async def drain() -> None:
            async for _ in self._decode(ticket):
                pass

        try:
            await asyncio.wait_for(drain(), cfg.request_timeout_s)
        except asyncio.TimeoutError:
            ticket.abandoned = True  # its batch stops computing it
            raise ClientError(408, f"not answered within {cfg.request_timeout_s} s") from None
        except asyncio.CancelledError:  # the client went away: Serve cancels its request
            ticket.abandoned = True
            raise
        except SHARD_LOST:
            raise ClientError(503, "the model's shards were lost twice under this request; retry") from None
        tokens = ticket.request.tokens
        return {"text": self.codec.decode(tokens), "tokens": len(tokens)}

    async def _events(self, ticket: Ticket) -> AsyncIterator[str]:
        """Server-sent events: {"token", "text"} per token, then {"done", "tokens"}, or {"error",
        "status"} if the request times out. Text comes piece by piece: a character split over
        several tokens appears with its last one."""
        text = TextStream(self.codec)
        deadline = ticket.arrived + self.config.request_timeout_s
        tokens = self._decode(ticket)
        try:
            while True:
                try:
                    token = await asyncio.wait_for(anext(tokens), deadline - time.perf_counter())
                except StopAsyncIteration:
                    break
                yield _event({"token": token, "text": text.push(token)})
            yield _event({"done": True, "tokens": len(ticket.request.tokens), "text": text.finish()})
        except asyncio.TimeoutError:
            yield _event({"error": f"not answered within {self.config.request_timeout_s} s", "status": 408})
        except SHARD_LOST:
            yield _event({"error": "the model's shards were lost twice under this request; retry", "status": 503})
        finally:  # finished, timed out or disconnected: either way its batch stops computing it
            ticket.abandoned = True

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
        if not self.generates or await asyncio.to_thread(self.model.healthy):
            return JSONResponse({"status": "ok", "model": self.kind})
        return _error(503, "a model shard is not answering; the shard group is being rebuilt")

    @api.get("/metrics")
    async def metrics_text(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    def check_health(self) -> None:
        """Serve's periodic health check: a dead shard gets the whole group rebuilt; only a group
        that cannot be rebuilt fails the replica (Serve then replaces it)."""
        if self.generates:
            seen = self.model.rebuilds
            if not self.model.healthy():
                self._rebuild(seen)

    # ------------------------------------------------------------------ batching

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _decode(self, tickets: list[Ticket]) -> AsyncIterator[list[Any]]:
        """Decode a batch together. After every forward pass, yield for each ticket its new token,
        or StopIteration once it has all of them or nobody waits for it any more."""
        started = time.perf_counter()
        live = [t for t in tickets if not t.abandoned]  # gone before their batch ran: dropped
        for ticket in live:
            self.metrics.queue.observe(started - ticket.arrived)
        self.metrics.batch_size.observe(len(live))
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
        self.metrics.compute.observe(elapsed)
        if self.adaptive and steps and self.adaptive.observe(len(live), elapsed / steps):
            self._decode.set_max_batch_size(self.adaptive.size)
            self.metrics.max_batch_size.set(self.adaptive.size)

    def _rebuild(self, failed: int) -> None:
        if self.model.rebuild(failed):
            self.metrics.rebuilds.inc()

    def _expect(self, generates: bool) -> None:
        if self.generates != generates:
            route = "/v1/completions" if self.generates else "/v1/predict"
            raise ClientError(404, f"this app serves a '{self.kind}' model: use {route}")


def build_app(args: dict[str, Any]) -> "serve.Application":
    """The Serve application for `args` (ServeConfig keys), validated before anything starts."""
    cfg = parse_config(args)
    generates = isinstance(read_spec(cfg.checkpoint).model, LANGUAGE_MODELS)
    ongoing = max(2 * cfg.max_batch_size, 8)  # a replica waits on its batch: admit more than one holds
    options: dict[str, Any] = dict(
        max_ongoing_requests=ongoing,
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
    if generates:  # the replica's own bundle, then one per shard: Serve reserves them together
        bundles = [{"CPU": REPLICA_CPUS}] + [shard_bundle(cfg.use_gpu, cfg.cpus_per_shard)] * cfg.num_shards
        try:  # a group no node can hold would leave the app waiting forever
            check_room(bundles, cfg.multi_node, f"a replica (its {REPLICA_CPUS} CPU and {cfg.num_shards} "
                                                f"shards of {cfg.cpus_per_shard:g} CPU{' and 1 GPU' if cfg.use_gpu else ''})")
        except ValueError as err:
            raise SpecError(f"invalid serve config: {err}") from None
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = "PACK" if cfg.multi_node else "STRICT_PACK"
    return ModelServer.options(**options).bind(cfg.model_dump())
