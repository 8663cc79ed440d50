"""A ServeConfig read against what it names: the checkpoint it serves (a run directory's newest
committed one), the model there and its tokenizer, the tokens from their variables or files, and
the settings left to `auto` decided for that model. Done where the config is used (the driver that
builds the app, each replica as it starts), so a token never travels in the bound arguments.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardyard.checkpoint.layout import is_hf_directory, serving_spec
from shardyard.checkpoint.loaders import servable
from shardyard.checkpoint.record import step_of
from shardyard.data.tokenizer import run_tokenizer
from shardyard.models.kv_layout import BLOCK_TOKENS
from shardyard.serve.config import (DEFAULT_CHECKPOINT, BatchingSettings, CanarySettings,
                                    EngineSettings, FollowSettings, LimitSettings, ServeConfig, parse_config)
from shardyard.serve.executor.model_pass import supports_kv_cache
from shardyard.serve.executor.shards import sharding_problem
from shardyard.serve.generation import TextCodec
from shardyard.spec import LANGUAGE_MODELS, ModuleSpec, SpecError


@dataclass(frozen=True)
class ResolvedConfig:
    config: ServeConfig  # checkpoint, batching.mode, engine.max_kv_tokens, follow.enabled, model_id decided
    source: str  # the checkpoint as given: a run directory stays one (replicas and rebuilds load its newest)
    use_gpu: bool
    served_step: int | None  # the training step of the checkpoint loaded (None: a model directory)
    fingerprint: str  # which weights answer: `<run>@<step>` (a model directory: its name), OpenAI's system_fingerprint
    tokenizer: Any  # a language model's: the model directory's, or the run's data's; None: UTF-8 bytes
    bearer_token: str | None  # the token requests need (None: no auth)
    admin_token: str | None  # the one the admin routes need (None: they are off)

    @property
    def checkpoint(self) -> str:
        return self.config.checkpoint

    @property
    def trust_factory(self) -> str | None:
        return self.config.trust_factory

    @property
    def model_id(self) -> str:
        return self.config.model_id or ""

    @property
    def engine(self) -> EngineSettings:
        return self.config.engine

    @property
    def batching(self) -> BatchingSettings:
        return self.config.batching

    @property
    def limits(self) -> LimitSettings:
        return self.config.limits

    @property
    def follow(self) -> FollowSettings:
        return self.config.follow

    @property
    def following(self) -> bool:
        return bool(self.config.follow.enabled)

    @property
    def canary(self) -> CanarySettings | None:
        return self.config.follow.canary

    @property
    def concurrency(self) -> int:
        return self.config.concurrency

    @property
    def codec(self) -> TextCodec:
        """Text to the model's tokens and back, through `tokenizer`."""
        return TextCodec(self.tokenizer)

    @property
    def stop_token(self) -> int | None:
        """The token that ends a sequence (None: UTF-8 bytes have none)."""
        return getattr(self.tokenizer, "eos_token_id", None)

    @property
    def cache_blocks(self) -> int:
        """Blocks of the paged KV cache (continuous batching), else 0."""
        tokens = self.config.engine.max_kv_tokens
        return -(-tokens // BLOCK_TOKENS) if self.config.batching.mode == "continuous" and tokens else 0

    def compiles(self, use_gpu: bool) -> bool:
        """Whether the engine's decode steps run compiled on these devices (`enforce_eager`)."""
        eager = self.config.engine.enforce_eager
        return use_gpu if eager is None else not eager

    def arguments(self) -> dict[str, Any]:
        """What a replica is given: the config with the checkpoint as given, never a token."""
        return {**self.config.arguments(), "checkpoint": self.source}

    def starting_at(self, checkpoint: Path) -> ResolvedConfig:
        """This config serving `checkpoint`, another committed checkpoint of the same run (the
        weights its app serves, chosen by a replica that starts after the others)."""
        step = step_of(checkpoint.name)
        return ResolvedConfig(self.config.model_copy(update={"checkpoint": str(checkpoint)}), self.source, self.use_gpu,
                              step, f"{self.fingerprint.rsplit('@', 1)[0]}@{step}", self.tokenizer, self.bearer_token,
                              self.admin_token)


def resolve(config: ServeConfig, use_gpu: bool) -> ResolvedConfig:
    """`config` read against its checkpoint, or a SpecError naming what is wrong."""
    try:
        return _resolve(config, use_gpu)
    except ValueError as err:
        raise SpecError(f"invalid serve config: {err}") from None


def load_config(args: dict[str, Any], use_gpu: bool) -> ResolvedConfig:
    return resolve(parse_config(args), use_gpu)


def _resolve(config: ServeConfig, use_gpu: bool) -> ResolvedConfig:
    auth = config.auth
    token = read_token(auth.bearer_token_env, auth.bearer_token_file, "auth.bearer_token")
    admin_token = read_token(auth.admin_token_env, auth.admin_token_file, "auth.admin_token")
    if admin_token is not None and admin_token == token:
        raise ValueError("auth.admin_token: it is the clients' bearer token too, so every client could roll the app "
                         "back; give the operator a token of their own")
    checkpoint = str(resolve_checkpoint(config.checkpoint))
    spec = serving_spec(checkpoint)
    model, engine, batching, follow = spec.model, config.engine, config.batching, config.follow
    if isinstance(model, ModuleSpec):
        raise ValueError(f"checkpoint: {checkpoint} holds a module of the user's own (model.name 'module'); serving "
                         f"answers language models (and the MLP): `shardyard export {checkpoint} model.safetensors "
                         f"--trust-factory {model.factory}` gives its weights for code of yours to serve")
    language = isinstance(model, LANGUAGE_MODELS)
    problem = sharding_problem(model, engine.num_shards, engine.sharding) if language else None
    if problem:
        raise ValueError(problem)
    tokenizer = None
    if language:
        tokenizer = serving_tokenizer(checkpoint, model)
        check_vocabulary(model, tokenizer)
    cached = language and supports_kv_cache(model)
    mode = batching.mode
    if mode == "auto":
        mode = "continuous" if cached else "adaptive"
    elif mode == "continuous" and not cached:
        raise ValueError(f"batching.mode: continuous needs a model the KV cache serves exactly (the GPT, or a "
                         f"Hugging Face model whose attention covers the whole context); this '{model.name}' model "
                         f"is served with batching.mode adaptive, fixed or none")
    kv_tokens = engine.max_kv_tokens
    if mode == "continuous":
        kv_tokens = kv_tokens or batching.max_batch_size * model.block_size
        if kv_tokens < model.block_size:
            raise ValueError(f"engine.max_kv_tokens ({kv_tokens}) is below one context window "
                             f"({model.block_size} tokens): no request could run")
    hf_directory = is_hf_directory(checkpoint)
    served_step = None if hf_directory else step_of(Path(checkpoint).name)
    a_run = Path(checkpoint) != Path(config.checkpoint).expanduser().resolve()  # a run: its newest was found
    followable = a_run and language
    if follow.enabled and not followable:
        raise ValueError("follow.enabled serves a run directory's new checkpoints as they commit, for a language "
                         "model; give checkpoint a run directory")
    enabled = followable if follow.enabled is None else follow.enabled
    if follow.canary is not None and not enabled:
        raise ValueError("follow.canary tries a followed run's new checkpoints on some replicas first: give "
                         "checkpoint a run directory")
    if follow.golden_prompts and not enabled:
        raise ValueError("follow.golden_prompts gate the checkpoints an app following a run swaps in: give "
                         "checkpoint a run directory")
    codec = TextCodec(tokenizer)
    for i, golden in enumerate(follow.golden_prompts):
        if len(codec.encode(golden.prompt)) + golden.max_tokens > model.block_size:
            raise ValueError(f"follow.golden_prompts[{i}]: its prompt's tokens plus max_tokens {golden.max_tokens} "
                             f"exceed the model's context of {model.block_size} tokens")
    decided = config.model_copy(update={
        "checkpoint": checkpoint,
        "model_id": config.model_id or (Path(checkpoint).name if hf_directory else spec.run.name),
        "batching": batching.model_copy(update={"mode": mode}),
        "engine": engine.model_copy(update={"max_kv_tokens": kv_tokens}),
        "follow": follow.model_copy(update={"enabled": enabled}),
    })
    fingerprint = Path(checkpoint).name if served_step is None else f"{spec.run.name}@{served_step}"
    return ResolvedConfig(decided, config.checkpoint, use_gpu, served_step, fingerprint, tokenizer, token, admin_token)


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
