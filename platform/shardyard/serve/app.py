"""The HTTP app: a Ray Serve deployment (FastAPI ingress) over a model trained by shardyard.

    POST /v1/completions  {"prompt": str, "max_tokens": int, "temperature": float, "seed": int}
    POST /v1/predict      {"inputs": [[float, ...], ...]}        (MLP checkpoints)
    GET  /healthz         200 while every shard answers
    GET  /metrics         Prometheus text: latency, queue time, batch size, rejections, tokens

Concurrent completions are grouped by `@serve.batch` and decoded together (ragged prompts
left-padded and masked, so each answer equals the unbatched one). Every mistake a client can make
gets a 4xx with a reason: malformed JSON 400, bad or missing credentials 401, body too large 413,
invalid fields 422 (naming the field), too slow 408; a full queue is answered 503 with
Retry-After by Serve itself (`max_queued_requests`).
"""


import asyncio
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.config import BackpressureConfig

from shardyard.serve.config import ServeConfig, parse_config
from shardyard.serve.generation import Completion, decode, encode, generate
from shardyard.serve.shards import ShardedGPT
from shardyard.spec import GPTSpec
from shardyard.train.checkpoint import load_model, read_spec

api = FastAPI(title="shardyard")


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    seed: int | None = None


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: list[list[float]] = Field(min_length=1)


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


REJECT_REASONS = {400: "malformed_json", 401: "unauthorized", 404: "wrong_model", 408: "timeout",
                  413: "body_too_large", 422: "invalid_field", 503: "unavailable"}


@api.middleware("http")
async def _limits_and_metrics(request: Request, call_next) -> Response:
    server = request.app.state.server  # the replica (ModelServer) serving this process
    cfg, start = server.config, time.perf_counter()
    response = _check_request(request, cfg, await request.body())
    if response is None:
        response = await call_next(request)
    server.metrics.latency.labels(request.url.path, str(response.status_code)).observe(time.perf_counter() - start)
    if response.status_code in REJECT_REASONS:
        server.metrics.rejected.labels(REJECT_REASONS[response.status_code]).inc()
    return response


def _check_request(request: Request, cfg: ServeConfig, body: bytes) -> Response | None:
    if request.method != "POST":
        return None
    if cfg.bearer_token and request.headers.get("authorization") != f"Bearer {cfg.bearer_token}":
        return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
    if len(body) > cfg.max_body_bytes:
        return _error(413, f"request body is {len(body)} bytes; the limit is {cfg.max_body_bytes}")
    return None


@serve.deployment
@serve.ingress(api)
class ModelServer:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = parse_config(config)
        api.state.server = self
        self.metrics = Metrics()
        model_spec = read_spec(self.config.checkpoint).model
        self.kind = model_spec.name
        if isinstance(model_spec, GPTSpec):
            self.block_size = model_spec.block_size
            self.model = ShardedGPT(self.config.checkpoint, self.config.num_shards, self.config.use_gpu,
                                    self.config.multi_node)
        else:  # the MLP: small, served whole by the replica
            self.mlp = load_model(self.config.checkpoint).eval()
            self.in_dim = model_spec.in_dim
        self._complete.set_max_batch_size(self.config.max_batch_size)
        self._complete.set_batch_wait_timeout_s(self.config.batch_wait_timeout_s)

    # ------------------------------------------------------------------ routes

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> dict[str, Any]:
        self._expect("gpt")
        cfg = self.config
        if len(body.prompt) > cfg.max_prompt_chars:
            raise ClientError(422, f"prompt is {len(body.prompt)} characters; the limit is "
                                   f"{cfg.max_prompt_chars}", "prompt")
        if body.max_tokens > cfg.max_tokens_limit:
            raise ClientError(422, f"max_tokens may be at most {cfg.max_tokens_limit}", "max_tokens")
        request = Completion(encode(body.prompt), body.max_tokens, body.temperature, body.seed)
        ticket = Ticket(request, time.perf_counter())
        try:
            tokens = await asyncio.wait_for(self._complete(ticket), cfg.request_timeout_s)
        except asyncio.TimeoutError:
            ticket.abandoned = True  # its batch stops computing it
            raise ClientError(408, f"not answered within {cfg.request_timeout_s} s") from None
        except asyncio.CancelledError:  # the client went away: Serve cancels its request
            ticket.abandoned = True
            raise
        return {"text": decode(tokens), "tokens": len(tokens)}

    @api.post("/v1/predict")
    async def predict(self, body: PredictRequest) -> dict[str, Any]:
        self._expect("mlp")
        bad = [i for i, row in enumerate(body.inputs) if len(row) != self.in_dim]
        if bad:
            raise ClientError(422, f"each input needs {self.in_dim} values; row {bad[0]} has "
                                   f"{len(body.inputs[bad[0]])}", "inputs")
        with torch.no_grad():
            outputs = self.mlp(torch.tensor(body.inputs))
        return {"outputs": outputs.tolist()}

    @api.get("/healthz")
    async def healthz(self) -> Response:
        if self.kind != "gpt" or await asyncio.to_thread(self.model.healthy):
            return JSONResponse({"status": "ok", "model": self.kind})
        return _error(503, "a model shard is not answering; the shard group is being rebuilt")

    @api.get("/metrics")
    async def metrics_text(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    def check_health(self) -> None:
        """Serve's periodic health check: a dead shard gets the whole group rebuilt; only a group
        that cannot be rebuilt fails the replica (Serve then replaces it)."""
        if self.kind == "gpt" and not self.model.healthy():
            self._rebuild()

    # ------------------------------------------------------------------ batching

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _complete(self, tickets: list[Ticket]) -> list[list[int]]:
        started = time.perf_counter()
        live = [t for t in tickets if not t.abandoned]  # gone before their batch ran: dropped
        for ticket in live:
            self.metrics.queue.observe(started - ticket.arrived)
        self.metrics.batch_size.observe(len(live))
        requests = [t.request for t in live]

        def run() -> list[list[int]]:
            return generate(self.model.forward, requests, self.block_size, lambda row: live[row].abandoned)

        try:
            tokens = await asyncio.to_thread(run) if live else []
        except ray.exceptions.RayActorError:  # a shard died under this batch: rebuild, run it again
            await asyncio.to_thread(self._rebuild)
            tokens = await asyncio.to_thread(run)
        answers = dict(zip(map(id, live), tokens))
        tokens = [answers.get(id(t), []) for t in tickets]
        self.metrics.compute.observe(time.perf_counter() - started)
        self.metrics.tokens.inc(sum(len(t) for t in tokens))
        return tokens

    def _rebuild(self) -> None:
        self.model.rebuild()
        self.metrics.rebuilds.inc()

    def _expect(self, kind: str) -> None:
        if self.kind != kind:
            route = "/v1/completions" if self.kind == "gpt" else "/v1/predict"
            raise ClientError(404, f"this app serves a '{self.kind}' model: use {route}")


def build_app(args: dict[str, Any]) -> "serve.Application":
    """The Serve application for `args` (ServeConfig keys), validated before anything starts."""
    cfg = parse_config(args)
    shard = {"GPU": 1.0, "CPU": 1.0} if cfg.use_gpu else {"CPU": 1.0}
    gpt = read_spec(cfg.checkpoint).model.name == "gpt"
    options: dict[str, Any] = dict(
        num_replicas=cfg.num_replicas,
        # Each replica waits on its batch: let more requests in than one batch holds.
        max_ongoing_requests=max(2 * cfg.max_batch_size, 8),
        max_queued_requests=cfg.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        ray_actor_options={"num_cpus": 0.5},
    )
    if gpt:  # the replica's own bundle, then one per shard: Serve reserves them together
        options["placement_group_bundles"] = [{"CPU": 0.5}] + [shard] * cfg.num_shards
        options["placement_group_strategy"] = "PACK" if cfg.multi_node else "STRICT_PACK"
    return ModelServer.options(**options).bind(cfg.model_dump())
