"""The serving app's parameters, from `serve run ... key=value` arguments or a Serve config
file's `args:`. Validated strictly (Serve's own schema would drop a misspelled key silently)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from shardyard.serve.shards import sharding_problem, supports_kv_cache
from shardyard.spec import LANGUAGE_MODELS, validate
from shardyard.train.checkpoint import is_hf_directory, read_spec, servable

DEFAULT_CHECKPOINT = "runs/gpt_ddp"  # where README's default training job writes


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _source: str = PrivateAttr("")

    checkpoint: str = Field(DEFAULT_CHECKPOINT, description="a checkpoint, a run directory (its latest), or a Hugging Face model directory")
    num_shards: int = Field(1, ge=1, description="shard actors the model is split across")
    sharding: Literal["pipeline", "tensor"] = Field(
        "pipeline", description="pipeline: contiguous blocks per shard; tensor: a slice of every linear")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    multi_node: bool = Field(False, description="PACK shards across nodes instead of STRICT_PACK on one")
    cpus_per_shard: float = Field(1.0, gt=0, description="Ray CPUs each shard's bundle reserves (beside a GPU "
                                  "each on GPUs); the replica's own bundle reserves 0.5")
    batching: Literal["auto", "continuous", "none", "fixed", "adaptive"] = Field(
        "auto", description="continuous: the decoding engine (KV cache, requests join and leave "
        "every token); none: one request per batch; fixed: max_batch_size and batch_wait_timeout_s "
        "as given; adaptive: measured at start, adjusted while serving; auto: continuous for models "
        "with a KV cache (the GPT), else adaptive")
    max_batch_size: int = Field(16, ge=1, description="the batch size (fixed), its upper bound (adaptive), "
                                "or the requests decoded at once (continuous)")
    max_kv_tokens: int | None = Field(None, ge=1, description="continuous: tokens the KV cache holds, "
                                      "a context window per running request (default max_batch_size x "
                                      "the context); beyond it requests wait")
    model_id: str | None = Field(None, min_length=1, max_length=128, description="the id /v1/models lists "
                                 "and requests name (default: the run's name or the model directory's)")
    batch_wait_timeout_s: float = Field(0.01, ge=0, description="fixed batching: longest wait to fill a batch")
    token_latency_target_ms: float = Field(
        100.0, gt=0, description="adaptive batching: the longest one decoding step (a token for "
        "every request in the batch) may take")
    num_replicas: int = Field(1, ge=1, description="replicas, or the autoscaling lower bound with max_replicas")
    max_replicas: int | None = Field(None, ge=1, description="autoscale between num_replicas and this")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="a replica being stopped finishes its in-flight requests for up to this long")
    max_queued_requests: int = Field(64, ge=1, description="beyond this, 503 with Retry-After")
    request_timeout_s: float = Field(30.0, gt=0, description="beyond this, 408")
    max_body_bytes: int = Field(16_384, ge=256, description="larger bodies get 413")
    max_prompt_chars: int = Field(4096, ge=1)
    max_tokens_limit: int = Field(256, ge=1, description="largest max_tokens a request may ask for")
    bearer_token: str | None = Field(None, min_length=1, description="when set, requests need Authorization: "
                                     "Bearer <token> (an empty token is refused, not read as no auth)")

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below num_replicas ({self.num_replicas})")
        self._source = self.checkpoint
        self.checkpoint = str(resolve_checkpoint(self.checkpoint))
        spec = read_spec(self.checkpoint)
        model = spec.model
        problem = sharding_problem(model, self.num_shards, self.sharding) if isinstance(model, LANGUAGE_MODELS) else None
        if problem:
            raise ValueError(problem)
        cached = isinstance(model, LANGUAGE_MODELS) and supports_kv_cache(model)
        if self.batching == "auto":
            self.batching = "continuous" if cached else "adaptive"
        elif self.batching == "continuous" and not cached:
            raise ValueError(f"batching: continuous needs a model with a KV cache (the GPT); a '{model.name}' "
                             f"model is served with batching: adaptive, fixed or none")
        if self.batching == "continuous":
            context = model.block_size
            self.max_kv_tokens = self.max_kv_tokens or self.max_batch_size * context
            if self.max_kv_tokens < context:
                raise ValueError(f"max_kv_tokens ({self.max_kv_tokens}) is below one context window "
                                 f"({context} tokens): no request could run")
        if self.model_id is None:
            self.model_id = Path(self.checkpoint).name if is_hf_directory(self.checkpoint) else spec.run.name
        return self

    @property
    def source(self) -> str:
        """The checkpoint as given: a run directory stays one, so replicas and shard rebuilds load
        its newest committed checkpoint when they start, not one training has since pruned."""
        return self._source

    @property
    def cache_rows(self) -> int:
        """Requests the KV cache holds at once (continuous batching), else 0."""
        if self.batching != "continuous":
            return 0
        return self.max_kv_tokens // read_spec(self.checkpoint).model.block_size

    @property
    def use_gpu(self) -> bool:
        if self.device == "auto":
            import os

            import ray

            if not ray.is_initialized():  # `serve run` builds the app before it connects
                ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
            return ray.cluster_resources().get("GPU", 0) >= self.num_shards
        return self.device == "cuda"


def resolve_checkpoint(path: str) -> Path:
    """What `servable` finds at `path`, or a ValueError that says how to get a checkpoint."""
    found = servable(path)
    if found is None:
        raise ValueError(f"no checkpoint at {str(Path(path).expanduser().resolve())!r}: train one first with "
                         f"`shardyard train jobs/configs/gpt_ddp.yaml` (it writes {DEFAULT_CHECKPOINT}/), or "
                         f"pass checkpoint=PATH")
    return found


def parse_config(args: dict[str, Any]) -> ServeConfig:
    return validate(ServeConfig, args, "invalid serve config")
