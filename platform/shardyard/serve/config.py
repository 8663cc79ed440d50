"""The serving app's parameters, from `serve run ... key=value` arguments or a Serve config
file's `args:`. Validated strictly (Serve's own schema would drop a misspelled key silently)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from shardyard.data.tokenizer import run_tokenizer
from shardyard.models.kv_cache import BLOCK_TOKENS
from shardyard.serve.generation import TextCodec
from shardyard.serve.engine.golden import GoldenPrompt
from shardyard.serve.executor.precision import DtypeName
from shardyard.serve.follow.rollout import CanarySettings
from shardyard.serve.executor.model_pass import supports_kv_cache
from shardyard.serve.executor.shards import sharding_problem
from shardyard.spec import LANGUAGE_MODELS, validate
from shardyard.checkpoint.layout import is_hf_directory, read_spec
from shardyard.checkpoint.loaders import servable
from shardyard.checkpoint.record import step_of

DEFAULT_CHECKPOINT = "runs/gpt_ddp"  # where README's default training job writes


# vLLM's names (`vllm serve` flags, without dashes) for settings that mean the same here;
# tensor_parallel_size and pipeline_parallel_size set num_shards and sharding.
VLLM_NAMES = {"max_num_seqs": "max_batch_size", "served_model_name": "model_id"}


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _source: str = PrivateAttr("")
    _served_step: int | None = PrivateAttr(None)
    _fingerprint: str = PrivateAttr("")
    _tokenizer: Any = PrivateAttr(None)  # language models: the serving tokenizer (None: UTF-8 bytes)
    _token: str | None = PrivateAttr(None)  # read where the config is parsed; never in the bound arguments
    _admin_token: str | None = PrivateAttr(None)  # the same, for the admin routes

    checkpoint: str = Field(DEFAULT_CHECKPOINT, description="a checkpoint, a run directory (its latest), or a Hugging Face model directory")
    trust_factory: str | None = Field(None, description="a custom model's factory ('module:function'), named by "
                                      "you: a factory named only by the run's stored spec is never imported")
    num_shards: int = Field(1, ge=1, description="shard actors the model is split across")
    sharding: Literal["pipeline", "tensor"] = Field(
        "pipeline", description="pipeline: contiguous blocks per shard; tensor: a slice of every linear")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: a GPU per shard when the cluster has them")
    dtype: DtypeName = Field(
        "auto", description="the weights' and KV cache's dtype (vLLM's setting): auto is float32 on CPUs and, on "
        "GPUs, the checkpoint's own 16-bit type (bfloat16 for a run's float32 weights); bfloat16 on a CPU with "
        "AVX-512 BF16 or AMX serves about 1.5x float32's tokens/s")
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
    max_kv_tokens: int | None = Field(None, ge=1, description="continuous: tokens the paged KV cache holds "
                                      "(default max_batch_size x the context); a request takes blocks for its "
                                      "prompt and max_tokens, and waits while there are not enough")
    engine: Literal["builtin", "vllm"] = Field(
        "builtin", description="vllm: vLLM's engine decodes a Hugging Face model (a model directory, or a run's "
        "model written out as one) behind the same routes, guard and metrics; where vLLM is not installed or "
        "cannot load the model, the built-in engine serves and says why in the replica's log")
    prefix_caching: bool = Field(True, description="continuous: prompts that begin with the same blocks of "
                                 "tokens as one in the cache read those blocks instead of prefilling them")
    enforce_eager: bool | None = Field(
        None, description="vLLM's setting: true: every pass eager; false: the engine's decode steps compiled "
        "(torch.compile, one shard in the replica's process; on GPUs replayed as CUDA graphs); default: compiled "
        "on GPUs, eager on CPUs, where a compiled 16-row decode step ran slower than the eager one over "
        "oneDNN-packed weights. A step that fails to compile says so once and every step runs eagerly")
    chunked_prefill: bool = Field(True, description="continuous: a prompt longer than the iteration's prefill "
                                  "budget is prefilled in chunks between decode steps (smoother inter-token "
                                  "latency; more forward passes); false: each prompt whole at once")
    follow: bool | None = Field(None, description="a language model served from a run directory: load each newly "
                                "committed (or published) checkpoint in the background and swap it in between "
                                "iterations or batches (vLLM: reloaded in a drained window), once it passes the "
                                "gate (default: true for a run directory, else false)")
    follow_interval_s: float = Field(2.0, gt=0, description="follow: how often the run is looked at")
    val_loss_tolerance: float | None = Field(
        0.05, ge=0, description="follow: a checkpoint whose validation loss (the last the run logged at or "
        "before its step) exceeds the served one's by more than this fraction is refused; null: not checked")
    golden_prompts: list[GoldenPrompt] = Field(
        default_factory=list, max_length=32, description="follow: prompts a new checkpoint decodes greedily before "
        "it serves (no client's request is decoded meanwhile); an answer farther than golden_max_edit_distance "
        "from the prompt's `expect`, or else from the served weights' own answer, refuses it")
    golden_max_edit_distance: int = Field(0, ge=0, description="follow: characters a golden answer may differ by")
    canary_fraction: float = Field(0.0, ge=0, lt=1, description="follow, with several replicas: the share of "
                                   "replicas a new checkpoint serves on first (at least one), before all or none")
    canary_window_s: float = Field(30.0, gt=0, description="canary: how long the canaries serve before the verdict")
    canary_min_requests: int = Field(20, ge=1, description="canary: requests the canaries answer before the verdict")
    canary_max_error_increase: float = Field(
        0.01, ge=0, le=1, description="canary: the error rate (failed requests, of all) it may have above the "
        "served weights' over the same window")
    canary_max_latency_ratio: float = Field(1.5, ge=1, description="canary: its mean request latency over the "
                                            "served weights', at most")
    canary_latency_margin_s: float = Field(
        0.05, ge=0, description="canary: how much slower on average it may be whatever the ratio (a fast "
        "model's milliseconds of noise are no regression)")
    model_id: str | None = Field(None, min_length=1, max_length=128, description="the id /v1/models lists "
                                 "and requests name (default: the run's name or the model directory's)")
    batch_wait_timeout_s: float = Field(0.01, ge=0, description="fixed batching: longest wait to fill a batch")
    token_latency_target_ms: float = Field(
        100.0, gt=0, description="adaptive batching: the longest one decoding step (a token for "
        "every request in the batch) may take")
    num_replicas: int = Field(1, ge=1, description="replicas, or the autoscaling lower bound with max_replicas")
    max_replicas: int | None = Field(None, ge=1, description="autoscale between num_replicas and this")
    upscale_delay_s: float = Field(30.0, ge=0, description="autoscaling: how long load must call for more "
                                   "replicas before Serve adds one (Serve's setting)")
    downscale_delay_s: float = Field(600.0, ge=0, description="autoscaling: how long load must call for fewer "
                                     "replicas before Serve stops one (Serve's setting)")
    look_back_period_s: float = Field(30.0, gt=0, description="autoscaling: the window Serve averages each "
                                      "replica's requests in flight over (Serve's setting)")
    device_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources a replica that decodes in its own process "
        "(num_shards 1) reserves beside its CPUs (and GPU): a pool's device")
    report_load_to: str | None = Field(None, min_length=1, description="the pool arbiter (a named Ray actor) "
                                       "each replica reports its engine's load to every second; set by "
                                       "`shardyard pool`")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="a replica being stopped finishes its in-flight requests for up to this long")
    max_queued_requests: int = Field(64, ge=1, description="beyond this, 503 with Retry-After")
    request_timeout_s: float = Field(30.0, gt=0, description="beyond this, 408")
    max_body_bytes: int = Field(16_384, ge=256, description="larger bodies get 413")
    max_prompt_chars: int = Field(4096, ge=1, description="longer prompts get 422")
    max_tokens_limit: int = Field(256, ge=1, description="largest max_tokens a request may ask for")
    max_choices_per_request: int = Field(8, ge=1, description="prompts times n one request may ask for; each "
                                         "choice counts against the replica's concurrency like a request")
    body_timeout_s: float = Field(10.0, gt=0, description="a request body not received whole within this "
                                  "gets 408 (a client that trickles its body holds a slot no longer)")
    max_pending_bodies: int = Field(256, ge=1, description="bodies a replica lets arrive at once; one more ends "
                                    "the oldest one's wait (408): trickled bodies never hold an ordinary request's slot")
    bearer_token_env: str | None = Field(None, min_length=1, description="the environment variable that holds "
                                         "the token requests need (Authorization: Bearer <token>)")
    bearer_token_file: str | None = Field(None, min_length=1, description="or the file that holds it")
    admin_token_env: str | None = Field(None, min_length=1, description="the environment variable that holds "
                                        "the operator's token, the only one /admin/rollback and /admin/promote "
                                        "take (off by default: they answer 403)")
    admin_token_file: str | None = Field(None, min_length=1, description="or the file that holds it")

    @model_validator(mode="before")
    @classmethod
    def _no_token_in_arguments(cls, args: Any) -> Any:
        for key in ("bearer_token", "admin_token"):
            if isinstance(args, dict) and key in args:
                raise ValueError(f"{key}: deployment arguments are shown by Serve's dashboard and API; put the "
                                 f"token in an environment variable ({key}_env=NAME) or a file ({key}_file=PATH)")
        return args

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, args: Any) -> Any:
        """vLLM's names for the settings that mean the same here, for its users' configs."""
        if not isinstance(args, dict):
            return args
        args = dict(args)
        for theirs, ours in VLLM_NAMES.items():
            if theirs in args:
                if ours in args:
                    raise ValueError(f"{theirs} is vLLM's name for {ours}: give one of them")
                args[ours] = args.pop(theirs)
        tensor, pipeline = args.pop("tensor_parallel_size", None), args.pop("pipeline_parallel_size", None)
        if tensor is None and pipeline is None:
            return args
        if "num_shards" in args or "sharding" in args:
            raise ValueError("tensor_parallel_size / pipeline_parallel_size set num_shards and sharding: give one "
                             "or the other")
        if tensor not in (None, 1) and pipeline not in (None, 1):
            raise ValueError("a model is split one way here: tensor_parallel_size or pipeline_parallel_size above "
                             "1, not both")
        if tensor not in (None, 1):
            args.update(num_shards=tensor, sharding="tensor")
        else:
            args.update(num_shards=pipeline if pipeline is not None else 1, sharding="pipeline")
        return args

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        self._token = read_token(self.bearer_token_env, self.bearer_token_file, "bearer_token")
        self._admin_token = read_token(self.admin_token_env, self.admin_token_file, "admin_token")
        if self._admin_token is not None and self._admin_token == self._token:
            raise ValueError("admin_token: it is the clients' bearer token too, so every client could roll the app "
                             "back; give the operator a token of their own")
        if self.device_resources and self.num_shards > 1:
            raise ValueError("device_resources: reserved by a replica that decodes in its own process (num_shards 1)")
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below num_replicas ({self.num_replicas})")
        self._source = self.checkpoint
        self.checkpoint = str(resolve_checkpoint(self.checkpoint))
        spec = read_spec(self.checkpoint)
        model = spec.model
        problem = sharding_problem(model, self.num_shards, self.sharding) if isinstance(model, LANGUAGE_MODELS) else None
        if problem:
            raise ValueError(problem)
        if isinstance(model, LANGUAGE_MODELS):
            self._tokenizer = serving_tokenizer(self.checkpoint, model)
            check_vocabulary(model, self._tokenizer)
        cached = isinstance(model, LANGUAGE_MODELS) and supports_kv_cache(model)
        if self.batching == "auto":
            self.batching = "continuous" if cached else "adaptive"
        elif self.batching == "continuous" and not cached:
            raise ValueError(f"batching: continuous needs a model the KV cache serves exactly (the GPT, or a "
                             f"Hugging Face model whose attention covers the whole context); this '{model.name}' "
                             f"model is served with batching: adaptive, fixed or none")
        if self.batching == "continuous":
            context = model.block_size
            self.max_kv_tokens = self.max_kv_tokens or self.max_batch_size * context
            if self.max_kv_tokens < context:
                raise ValueError(f"max_kv_tokens ({self.max_kv_tokens}) is below one context window "
                                 f"({context} tokens): no request could run")
        if self.max_choices_per_request > self.concurrency:
            raise ValueError(f"max_choices_per_request ({self.max_choices_per_request}) is over what a replica "
                             f"decodes at once ({self.concurrency}, from max_batch_size): no such request could run")
        if self.model_id is None:
            self.model_id = Path(self.checkpoint).name if is_hf_directory(self.checkpoint) else spec.run.name
        self._served_step = None if is_hf_directory(self.checkpoint) else step_of(Path(self.checkpoint).name)
        a_run = Path(self.checkpoint) != Path(self._source).expanduser().resolve()  # a run: its newest was found
        followable = a_run and isinstance(model, LANGUAGE_MODELS)
        if self.follow and not followable:
            raise ValueError("follow: true serves a run directory's new checkpoints as they commit, for a language "
                             "model; give checkpoint a run directory")
        if self.follow is None:
            self.follow = followable
        if self.canary_fraction and not (self.follow and (self.max_replicas or self.num_replicas) > 1):
            raise ValueError("canary_fraction compares a new checkpoint on some replicas with the others: it needs "
                             "follow: true and more than one replica (num_replicas or max_replicas)")
        if self.golden_prompts and not self.follow:
            raise ValueError("golden_prompts gate the checkpoints an app following a run swaps in (follow: true)")
        for i, golden in enumerate(self.golden_prompts):
            if len(self.codec.encode(golden.prompt)) + golden.max_tokens > model.block_size:
                raise ValueError(f"golden_prompts[{i}]: its prompt's tokens plus max_tokens {golden.max_tokens} "
                                 f"exceed the model's context of {model.block_size} tokens")
        self._fingerprint = (Path(self.checkpoint).name if self._served_step is None
                             else f"{spec.run.name}@{self._served_step}")
        return self

    def starting_at(self, checkpoint: Path) -> ServeConfig:
        """This config serving `checkpoint`, another committed checkpoint of the same run (the
        weights its app serves, chosen by a replica that starts after the others)."""
        moved = self.model_copy(update={"checkpoint": str(checkpoint)})
        moved._served_step = step_of(checkpoint.name)
        moved._fingerprint = f"{self._fingerprint.rsplit('@', 1)[0]}@{moved._served_step}"
        return moved

    @property
    def served_step(self) -> int | None:
        """The training step of the checkpoint this replica loaded (None: a model directory)."""
        return self._served_step

    @property
    def fingerprint(self) -> str:
        """Which weights answer: `<run>@<step>` (a model directory: its name). Every response and
        stream chunk carries it as OpenAI's `system_fingerprint`."""
        return self._fingerprint

    @property
    def source(self) -> str:
        """The checkpoint as given: a run directory stays one, so replicas and shard rebuilds load
        its newest committed checkpoint when they start, not one training has since pruned."""
        return self._source

    @property
    def tokenizer(self) -> Any:
        """What turns text into the model's tokens: the tokenizer a Hugging Face model directory
        brings, or the one the run's data was prepared with; None: UTF-8 bytes are the tokens."""
        return self._tokenizer

    @property
    def codec(self) -> TextCodec:
        """Text to the model's tokens and back, through `tokenizer`."""
        return TextCodec(self._tokenizer)

    @property
    def stop_token(self) -> int | None:
        """The token that ends a sequence (None: UTF-8 bytes have none)."""
        return getattr(self._tokenizer, "eos_token_id", None)

    @property
    def canary(self) -> CanarySettings | None:
        if not self.canary_fraction:
            return None
        return CanarySettings(self.canary_fraction, self.canary_window_s, self.canary_min_requests,
                              self.canary_max_error_increase, self.canary_max_latency_ratio,
                              self.canary_latency_margin_s)

    @property
    def bearer_token(self) -> str | None:
        """The token requests need, or None: no auth."""
        return self._token

    @property
    def admin_token(self) -> str | None:
        """The token the admin routes need, or None: they are off."""
        return self._admin_token

    @property
    def concurrency(self) -> int:
        """Choices the engine takes at once (a request with several prompts or n > 1 counts once
        per choice against this): above one full batch, since a replica waits on its batch."""
        return max(2 * self.max_batch_size, 8)

    @property
    def cache_blocks(self) -> int:
        """Blocks of the paged KV cache (continuous batching), else 0."""
        return -(-self.max_kv_tokens // BLOCK_TOKENS) if self.batching == "continuous" else 0

    def compiles(self, use_gpu: bool) -> bool:
        """Whether the engine's decode steps run compiled on these devices (`enforce_eager`)."""
        return use_gpu if self.enforce_eager is None else not self.enforce_eager

    @property
    def use_gpu(self) -> bool:
        if self.device == "auto":
            import ray

            from shardyard.cluster import address_to_join

            if not ray.is_initialized():  # `serve run` builds the app before it connects
                ray.init(address=address_to_join())
            return ray.cluster_resources().get("GPU", 0) >= self.num_shards
        return self.device == "cuda"


def resolve_checkpoint(path: str) -> Path:
    """What `servable` finds at `path`, or a ValueError that says how to get a checkpoint."""
    if "://" in path:  # as a local path it would name a directory "s3:" and report nothing found
        raise ValueError(f"checkpoint {path!r}: serving reads a local or shared directory, not object storage; "
                         f"copy the run (or one checkpoint of it) down first, e.g. `aws s3 sync {path} DIR`, "
                         f"and pass checkpoint=DIR")
    found = servable(path)
    if found is None:
        raise ValueError(f"no checkpoint at {str(Path(path).expanduser().resolve())!r}: train one first with "
                         f"`shardyard train jobs/configs/gpt_ddp.yaml` (it writes {DEFAULT_CHECKPOINT}/), or "
                         f"pass checkpoint=PATH")
    return found


def serving_tokenizer(checkpoint: str, model: Any) -> Any:
    if getattr(model, "brings_tokenizer", False):
        from shardyard.models.hf import load_tokenizer

        return load_tokenizer(model)
    return run_tokenizer(checkpoint)


def check_vocabulary(model: Any, tokenizer: Any) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding: else every
    request would fail (on CUDA, an out-of-range index also breaks the device for good)."""
    ids, kind = (256, "UTF-8 bytes (ids 0-255)") if tokenizer is None else (len(tokenizer), "its tokenizer")
    if ids > model.vocab_size:
        raise ValueError(f"the model's vocabulary has {model.vocab_size} ids but the text is tokenized with {kind}, "
                         f"which has {ids}: this checkpoint was not trained on text this server can encode "
                         f"(a model trained on synthetic token ids cannot serve text)")


MIN_TOKEN_CHARS = 16  # `openssl rand -hex 32` makes 64; a short token is guessed


def read_token(env: str | None, file: str | None, name: str) -> str | None:
    """The token `name` from its variable or file (surrounding whitespace dropped); one that is
    missing, empty or shorter than MIN_TOKEN_CHARS is an error, never "no auth". A file others
    can read or write is refused, as ssh refuses such a private key: any local user could take
    the token, or put theirs in its place."""
    if env and file:
        raise ValueError(f"give {name}_env or {name}_file, not both")
    if env:
        if env not in os.environ:
            raise ValueError(f"{name}_env: the environment variable {env} is not set")
        token, where = os.environ[env].strip(), f"the environment variable {env}"
    elif file:
        path = Path(file).expanduser()
        try:
            mode = path.stat().st_mode
            token, where = path.read_text().strip(), f"the file {file}"
        except OSError as err:
            raise ValueError(f"{name}_file: cannot read {file}: {err.strerror}") from None
        if mode & 0o077:
            raise ValueError(f"{name}_file: {file} can be read or written by other users (mode "
                             f"{stat.S_IMODE(mode):03o}); make it private: chmod 600 {file}")
    else:
        return None
    if not token:
        raise ValueError(f"{name}: {where} is empty (an empty token would let every request in)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{name}: {where} holds {len(token)} characters; a token needs at least "
                         f"{MIN_TOKEN_CHARS} (make one with: openssl rand -hex 32)")
    return token


def parse_config(args: dict[str, Any]) -> ServeConfig:
    return validate(ServeConfig, args, "invalid serve config")
