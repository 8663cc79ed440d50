"""The serving app's parameters, from `serve run ... key=value` arguments or a Serve config
file's `args:`. Validated strictly (Serve's own schema would drop a misspelled key silently)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardyard.spec import validate
from shardyard.train.checkpoint import STATE_FILE, find_latest

DEFAULT_CHECKPOINT = "runs/gpt_ddp"  # where README's default training job writes


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(DEFAULT_CHECKPOINT, description="a checkpoint, or a run directory (its latest)")
    num_shards: int = Field(1, ge=1, description="shard actors the model is split across")
    sharding: Literal["pipeline"] = Field("pipeline", description="contiguous blocks per shard")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    multi_node: bool = Field(False, description="PACK shards across nodes instead of STRICT_PACK on one")
    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(0.01, ge=0)
    num_replicas: int = Field(1, ge=1)
    max_queued_requests: int = Field(64, ge=1, description="beyond this, 503 with Retry-After")
    request_timeout_s: float = Field(30.0, gt=0, description="beyond this, 408")
    max_body_bytes: int = Field(16_384, ge=256, description="larger bodies get 413")
    max_prompt_chars: int = Field(4096, ge=1)
    max_tokens_limit: int = Field(256, ge=1, description="largest max_tokens a request may ask for")
    bearer_token: str | None = Field(None, description="when set, requests need Authorization: Bearer <token>")

    @model_validator(mode="after")
    def _resolve_checkpoint(self) -> ServeConfig:
        self.checkpoint = str(resolve_checkpoint(self.checkpoint))
        return self

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
    """A checkpoint directory as given, or a run directory's latest complete checkpoint."""
    given = Path(path).expanduser().resolve()
    if (given / STATE_FILE).is_file():
        return given
    latest = find_latest(given) if given.is_dir() else None
    if latest is None:
        raise ValueError(f"no checkpoint at {str(given)!r}: train one first with `shardyard train "
                         f"jobs/configs/gpt_ddp.yaml` (it writes {DEFAULT_CHECKPOINT}/), or pass "
                         f"checkpoint=PATH")
    return latest


def parse_config(args: dict[str, Any]) -> ServeConfig:
    return validate(ServeConfig, args, "invalid serve config")
