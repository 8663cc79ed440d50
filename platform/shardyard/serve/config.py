"""The serving app's parameters, from `serve run ... key=value` arguments (a dotted key for a
section's setting: `batching.max_batch_size=8`), a Serve config file's `args:` or `shardyard serve
--set`. Pure schema, nested by concern: the engine that decodes, batching, the limits a client
meets, auth, following a run, and Serve's own autoscaling options passed through. Validated
strictly (Serve's own schema would drop a misspelled key silently); nothing here reads a file or
starts Ray: serve/resolved.py reads the config against its checkpoint.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shardyard.spec import Section, did_you_mean, validate

DEFAULT_CHECKPOINT = "runs/gpt_ddp"  # where README's default training job writes

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]

# vLLM's names (`vllm serve` flags, without dashes) for settings that mean the same here;
# tensor_parallel_size and pipeline_parallel_size set engine.num_shards and engine.sharding.
VLLM_NAMES = {"max_num_seqs": "batching.max_batch_size", "served_model_name": "model_id"}


class EngineSettings(Section):
    backend: Literal["builtin", "vllm"] = Field(
        "builtin", description="vllm: vLLM's engine decodes a Hugging Face model (a model directory, or a run's "
        "model written out as one) behind the same routes, guard and metrics; where vLLM is not installed or "
        "cannot load the model, the built-in engine serves and says why in the replica's log (`shardyard serve "
        "--engine vllm` stops instead, naming the install, where this Python has no vLLM)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: a GPU per shard when the cluster has them")
    dtype: DtypeName = Field(
        "auto", description="the weights' and KV cache's dtype (vLLM's setting): auto is float32 on CPUs and, on "
        "GPUs, the checkpoint's own 16-bit type (bfloat16 for a run's float32 weights); bfloat16 on a CPU with "
        "AVX-512 BF16 or AMX serves about 1.5x float32's tokens/s")
    num_shards: int = Field(1, ge=1, description="shard actors the model is split across")
    sharding: Literal["pipeline", "tensor"] = Field(
        "pipeline", description="pipeline: contiguous blocks per shard; tensor: a slice of every linear")
    multi_node: bool = Field(False, description="PACK shards across nodes instead of STRICT_PACK on one")
    cpus_per_shard: float = Field(1.0, gt=0, description="Ray CPUs each shard's bundle reserves (beside a GPU "
                                  "each on GPUs); the replica's own bundle reserves 0.5")
    cpu_threads: int | None = Field(
        None, ge=1, description="one shard on a CPU: the OpenMP threads every pass runs on (in the engine core, or the "
        "replica for static batches); default: the replica's CPUs and the shard's, rounded up (2), and an eager "
        "one-row decode step on the shard's own (1): on 2 cores one thread gave a lower time per token at one "
        "stream, two more tokens/s at 16")
    device_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources a replica that decodes in its own process "
        "(num_shards 1) reserves beside its CPUs (and GPU): a pool's device")
    max_kv_tokens: int | None = Field(None, ge=1, description="continuous batching: tokens the paged KV cache holds "
                                      "(default batching.max_batch_size x the context); a request takes blocks for "
                                      "its prompt and max_tokens, and waits while there are not enough")
    prefix_caching: bool = Field(True, description="continuous batching: prompts that begin with the same blocks of "
                                 "tokens as one in the cache read those blocks instead of prefilling them")
    chunked_prefill: bool = Field(True, description="continuous batching: a prompt longer than the iteration's "
                                  "prefill budget is prefilled in chunks between decode steps (smoother inter-token "
                                  "latency; more forward passes); false: each prompt whole at once")
    attention: Literal["auto", "paged", "lanes"] = Field(
        "auto", description="continuous batching: how attention reads the KV cache. paged: from its blocks where "
        "they lie (FlexAttention, compiled); lanes: from a second copy of each running sequence's keys and values, "
        "one row of positions per sequence, read in place (up to batching.max_batch_size contexts more memory); "
        "auto: paged on GPUs, lanes on CPUs, where they measured faster")
    enforce_eager: bool | None = Field(
        None, description="vLLM's setting: true: every pass eager; false: the engine's decode steps compiled "
        "(torch.compile, one shard in one process; on GPUs replayed as CUDA graphs, on CPUs a frozen graph whose "
        "matrix products are autotuned); default: compiled on GPUs, eager on CPUs, where compiling adds minutes to "
        "the start (and to a swap's first steps) and about halves the time per token at one stream. A step that "
        "fails to compile says so once and every step runs eagerly")

    def paged_attention(self, use_gpu: bool) -> bool:
        """Whether attention reads the KV cache's blocks in place on these devices (`attention`)."""
        return use_gpu if self.attention == "auto" else self.attention == "paged"

    @model_validator(mode="after")
    def _check(self) -> EngineSettings:
        if self.device_resources and self.num_shards > 1:
            raise ValueError("device_resources: reserved by a replica that decodes in its own process (num_shards 1)")
        return self


class BatchingSettings(Section):
    mode: Literal["auto", "continuous", "none", "fixed", "adaptive"] = Field(
        "auto", description="continuous: the decoding engine (KV cache, requests join and leave every token); "
        "none: one request per batch; fixed: max_batch_size and batch_wait_timeout_s as given; adaptive: measured "
        "at start, adjusted while serving; auto: continuous for models with a KV cache (the GPT), else adaptive")
    max_batch_size: int = Field(16, ge=1, description="the batch size (fixed), its upper bound (adaptive), "
                                "or the requests decoded at once (continuous)")
    batch_wait_timeout_s: float = Field(0.01, ge=0, description="fixed: longest wait to fill a batch")
    token_latency_target_ms: float = Field(
        100.0, gt=0, description="continuous: sets the prefill budget; adaptive: the longest one decoding step "
        "(a token for every request in the batch) may take")


class LimitSettings(Section):
    max_queued_requests: int = Field(64, ge=1, description="beyond this, 503 with Retry-After")
    request_timeout_s: float = Field(30.0, gt=0, description="beyond this, 408")
    max_body_bytes: int = Field(16_384, ge=256, description="larger bodies get 413")
    max_prompt_chars: int = Field(4096, ge=1, description="longer prompts get 400")
    max_tokens_limit: int = Field(256, ge=1, description="largest max_tokens a request may ask for")
    max_choices_per_request: int = Field(8, ge=1, description="prompts times n one request may ask for; each "
                                         "choice counts against the replica's concurrency like a request")
    body_timeout_s: float = Field(10.0, gt=0, description="a request body not received whole within this "
                                  "gets 408 (a client that trickles its body holds a slot no longer)")
    max_pending_bodies: int = Field(256, ge=1, description="bodies a replica lets arrive at once; one more ends "
                                    "the oldest one's wait (408): trickled bodies never hold an ordinary request's slot")


class AuthSettings(Section):
    bearer_token_env: str | None = Field(None, min_length=1, description="the environment variable that holds "
                                         "the token requests need (Authorization: Bearer <token>)")
    bearer_token_file: str | None = Field(None, min_length=1, description="or the file that holds it")
    admin_token_env: str | None = Field(None, min_length=1, description="the environment variable that holds "
                                        "the operator's token, the only one /admin/rollback and /admin/promote "
                                        "take (off by default: they answer 403)")
    admin_token_file: str | None = Field(None, min_length=1, description="or the file that holds it")

    @model_validator(mode="after")
    def _one_place_each(self) -> AuthSettings:
        for name in ("bearer_token", "admin_token"):
            if getattr(self, f"{name}_env") and getattr(self, f"{name}_file"):
                raise ValueError(f"give {name}_env or {name}_file, not both")
        return self


class GoldenPrompt(Section):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1, description="tokens decoded greedily")
    expect: str | None = Field(None, description="the answer it must give (default: the served weights' own)")


class CanarySettings(Section):
    fraction: float = Field(gt=0, lt=1, description="the share of replicas a new checkpoint serves on first (at "
                            "least one), before all or none")
    window_s: float = Field(30.0, gt=0, description="how long the canaries serve before the verdict")
    min_requests: int = Field(20, ge=1, description="requests the canaries answer before the verdict")
    max_error_increase: float = Field(
        0.01, ge=0, le=1, description="the error rate (failed requests, of all) it may have above the served "
        "weights' over the same window")
    max_latency_ratio: float = Field(1.5, ge=1, description="its mean request latency over the served weights', "
                                     "at most")
    latency_margin_s: float = Field(0.05, ge=0, description="how much slower on average it may be whatever the "
                                    "ratio (a fast model's milliseconds of noise are no regression)")


class FollowSettings(Section):
    enabled: bool | None = Field(None, description="a language model served from a run directory: load each newly "
                                 "committed (or published) checkpoint in the background and swap it in between "
                                 "iterations or batches (vLLM: reloaded in a drained window), once it passes the "
                                 "gate (default: true for a run directory, else false; `follow: false` for short)")
    interval_s: float = Field(2.0, gt=0, description="how often the run is looked at")
    val_loss_tolerance: float | None = Field(
        0.05, ge=0, description="a checkpoint whose validation loss (the last the run logged at or before its "
        "step) exceeds the served one's by more than this fraction is refused; null: not checked")
    golden_prompts: list[GoldenPrompt] = Field(
        default_factory=list, max_length=32, description="prompts a new checkpoint decodes greedily before it "
        "serves (no client's request is decoded meanwhile); an answer farther than golden_max_edit_distance from "
        "the prompt's `expect`, or else from the served weights' own answer, refuses it")
    golden_max_edit_distance: int = Field(0, ge=0, description="characters a golden answer may differ by")
    canary: CanarySettings | None = Field(None, description="with several replicas: a new checkpoint serves on "
                                          "`fraction` of them first, then on all or none (null: on all at once)")


# A section given as one word, for the setting it is mostly about: `engine: vllm`, `batching:
# fixed`, `follow: false`.
SHORTHANDS = {"engine": "backend", "batching": "mode", "follow": "enabled"}
SECTIONS = {"engine": EngineSettings, "batching": BatchingSettings, "limits": LimitSettings, "auth": AuthSettings,
            "follow": FollowSettings}


class ServeConfig(Section):
    checkpoint: str = Field(DEFAULT_CHECKPOINT, description="a checkpoint, a run directory (its latest), or a Hugging Face model directory")
    trust_factory: str | None = Field(None, description="a custom model's factory ('module:function'), named by "
                                      "you: a factory named only by the run's stored spec is never imported")
    model_id: str | None = Field(None, min_length=1, max_length=128, description="the id /v1/models lists "
                                 "and requests name (default: the run's name or the model directory's)")
    num_replicas: int | None = Field(None, ge=1, description="replicas (default 1), or give autoscaling")
    autoscaling: dict[str, Any] | None = Field(
        None, description="Serve's autoscaling_config, passed through (min_replicas, max_replicas, "
        "upscale_delay_s, ...; target_ongoing_requests defaults to batching.max_batch_size: a replica is busy at "
        "one full batch)")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="a replica being stopped finishes its in-flight requests for up to this long")
    report_load_to: str | None = Field(None, min_length=1, description="the pool arbiter (a named Ray actor) "
                                       "each replica reports its engine's load to every second; set by "
                                       "`shardyard pool`")
    engine: EngineSettings = Field(default_factory=EngineSettings)
    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    follow: FollowSettings = Field(default_factory=FollowSettings)

    @model_validator(mode="before")
    @classmethod
    def _arguments(cls, args: Any) -> Any:
        """Dotted keys into their sections, vLLM's names and the one-word sections into ours."""
        if not isinstance(args, dict):
            return args
        nested: dict[str, Any] = {}
        for key, value in args.items():
            *sections, name = str(key).split(".")
            if sections:
                node = nested
                for section in sections:
                    node = _section_of(node, section, key)
                node[name] = value
            elif isinstance(value, dict) and isinstance(nested.get(key), dict):
                nested[key] = {**value, **nested[key]}
            elif key in SHORTHANDS and isinstance(nested.get(key), dict):
                nested[key][SHORTHANDS[key]] = value
            else:
                nested[key] = value
        for key in ("bearer_token", "admin_token"):
            if key in nested or (isinstance(nested.get("auth"), dict) and key in nested["auth"]):
                raise ValueError(f"{key}: deployment arguments are shown by Serve's dashboard and API; put the "
                                 f"token in an environment variable (auth.{key}_env=NAME) or a file "
                                 f"(auth.{key}_file=PATH)")
        for section, setting in SHORTHANDS.items():
            if section in nested and not isinstance(nested[section], dict):
                nested[section] = {setting: nested[section]}
        _vllm_names(nested)
        misplaced = [f"{key} is {section}.{key}" for key in nested if key not in cls.model_fields
                     for section, model in SECTIONS.items() if key in model.model_fields]
        if misplaced:
            raise ValueError("settings belong to sections (`section.key=value`, or nested under the section in a "
                             "config file): " + "; ".join(misplaced))
        return nested

    @field_validator("autoscaling")
    @classmethod
    def _serve_autoscaling(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        """Serve's own options, checked by Serve's own model (which ignores a key it does not know)."""
        if options is None:
            return None
        from pydantic import ValidationError
        from ray.serve.config import AutoscalingConfig  # Serve's schema only: nothing starts

        for key in options:
            if key not in AutoscalingConfig.model_fields:
                hint = did_you_mean(key, list(AutoscalingConfig.model_fields))
                raise ValueError(f"autoscaling: {key!r} is not one of Serve's options{f' ({hint})' if hint else ''}")
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # what Serve will refuse in a later release, refused now
            try:
                AutoscalingConfig.model_validate(options)
            except ValidationError as err:
                raise ValueError("autoscaling: " + "; ".join(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}"
                                                             f"{e['msg'].removeprefix('Value error, ')}"
                                                             for e in err.errors())) from None
            except FutureWarning as warning:
                raise ValueError(f"autoscaling: {warning}") from None
        return options

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("num_replicas sets a fixed number of replicas; autoscaling's min_replicas and "
                             "max_replicas bound a varying one: give one of them")
        if self.limits.max_choices_per_request > self.concurrency:
            raise ValueError(f"limits.max_choices_per_request ({self.limits.max_choices_per_request}) is over what a "
                             f"replica decodes at once ({self.concurrency}, from batching.max_batch_size): no such "
                             f"request could run")
        if self.follow.canary is not None and (self.follow.enabled is False or self.most_replicas < 2):
            raise ValueError("follow.canary compares a new checkpoint on some replicas with the others: it needs "
                             "follow and more than one replica (num_replicas or autoscaling.max_replicas)")
        if self.follow.golden_prompts and self.follow.enabled is False:
            raise ValueError("follow.golden_prompts gate the checkpoints an app following a run swaps in "
                             "(follow.enabled)")
        return self

    @property
    def most_replicas(self) -> int:
        if self.autoscaling is not None:
            return int(self.autoscaling.get("max_replicas", 1))
        return self.num_replicas or 1

    @property
    def concurrency(self) -> int:
        """Choices the engine takes at once (a request with several prompts or n > 1 counts once
        per choice against this): above one full batch, since a replica waits on its batch."""
        return max(2 * self.batching.max_batch_size, 8)

    def arguments(self) -> dict[str, Any]:
        """The arguments that make this config again (what a replica is given)."""
        return self.model_dump(exclude_defaults=True)


def _section_of(args: dict[str, Any], section: str, key: str) -> dict[str, Any]:
    """The section a dotted key goes into, made a section where one word stood for it."""
    into = args.setdefault(section, {})
    if not isinstance(into, dict) and section in SHORTHANDS:
        into = args[section] = {SHORTHANDS[section]: into}
    if not isinstance(into, dict):
        raise ValueError(f"{key}: {section} is a setting, not a section")
    return into


def _vllm_names(args: dict[str, Any]) -> None:
    """vLLM's names for the settings that mean the same here, for its users' configs."""
    for theirs, ours in VLLM_NAMES.items():
        if theirs in args:
            section, _, name = ours.rpartition(".")
            into = _section_of(args, section, theirs) if section else args
            if name in into:
                raise ValueError(f"{theirs} is vLLM's name for {ours}: give one of them")
            into[name] = args.pop(theirs)
    tensor, pipeline = args.pop("tensor_parallel_size", None), args.pop("pipeline_parallel_size", None)
    if tensor is None and pipeline is None:
        return
    engine = args.setdefault("engine", {})
    if "num_shards" in engine or "sharding" in engine:
        raise ValueError("tensor_parallel_size / pipeline_parallel_size set engine.num_shards and engine.sharding: "
                         "give one or the other")
    if tensor not in (None, 1) and pipeline not in (None, 1):
        raise ValueError("a model is split one way here: tensor_parallel_size or pipeline_parallel_size above 1, "
                         "not both")
    if tensor not in (None, 1):
        engine.update(num_shards=tensor, sharding="tensor")
    else:
        engine.update(num_shards=pipeline if pipeline is not None else 1, sharding="pipeline")


def parse_config(args: dict[str, Any]) -> ServeConfig:
    return validate(ServeConfig, args, "invalid serve config")
