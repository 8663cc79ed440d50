"""A training run's checkpoints for the serving tests: written by the real CheckpointManager into
one run directory as training writes them, each step's weights drawn from a seed; and what those
weights answer when decoded alone in this process; a replica's weight follower over one, in this
process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from shardyard.checkpoint.layout import TrainState, read_spec
from shardyard.checkpoint.loaders import load_model
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.serve.engine.builtin import BuiltinEngine
from shardyard.serve.engine.metrics import ServingMetrics
from shardyard.serve.follow.app_weights import AppWeights
from shardyard.serve.follow.follower import WeightFollower
from shardyard.serve.follow.gate import WeightGate, served_at_start
from shardyard.serve.generation import Completion, decode, encode, generate
from shardyard.serve.resolved import load_config
from shardyard.spec import load_spec

from helpers.engine import CachedModel, engine_for, serve_all
from helpers.repo import REPO

PROMPT = "def main():\n    "
LONG_CONTEXT = ("model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=2048")

# Weights spread around the initialisation as training spreads them: a freshly initialised GPT
# (tied embeddings) repeats its prompt's last byte whatever its seed, so two steps would answer alike.
SPREAD = 0.3


def commit_checkpoint(rank: int, world: int, run_dir: str, step: int, seed: int, jitter: float, fault: str | None,
                      overrides: tuple[str, ...], config: str) -> None:
    """The job `config`'s checkpoint of `step` (its model as `overrides` say), its weights drawn
    from `seed`, then moved by Gaussian `jitter` drawn from `step`. `fault`: "nan", one weight
    NaN (as a diverged run leaves it); "overflow", finite weights whose logits overflow to NaN
    (every request fails, yet each weight passes the finiteness check)."""
    spec = load_spec(REPO / "jobs" / "configs" / config, overrides)
    torch.manual_seed(seed)
    model = build_model(spec.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(SPREAD * torch.randn_like(p))
        torch.manual_seed(step)
        for p in model.parameters():
            p.add_(jitter * torch.randn_like(p))
        if fault == "nan":
            next(model.parameters()).view(-1)[0] = float("nan")
        if fault == "overflow":
            model.ln_f.weight.fill_(3e38)
    CheckpointManager(run_dir, keep=3).save(build_engine(spec, model, torch.device("cpu")),
                                            TrainState(step, 0, world), spec)


def commit(run_dir: Path, step: int, seed: int | None = None, jitter: float = 0.0, fault: str | None = None,
           overrides: tuple[str, ...] = LONG_CONTEXT, config: str = "gpt_ddp.yaml") -> None:
    run_distributed(commit_checkpoint, 1, str(run_dir), step, step if seed is None else seed, jitter, fault,
                    overrides, config)


def alone(checkpoint: Path, max_tokens: int = 12) -> str:
    """The greedy answer of `checkpoint`'s weights, decoded in this process (recomputing the
    whole sequence at every token)."""
    model = load_model(checkpoint).eval()
    return decode(generate(torch.no_grad()(model), [Completion(encode(PROMPT), max_tokens)],
                           model.spec.block_size)[0])


def alone_cached(checkpoint: Path, max_tokens: int) -> str:
    """The same, for a long answer: decoded by the engine over a KV cache in this process."""
    model = load_model(checkpoint).eval()
    request = Completion(encode(PROMPT), max_tokens)
    return decode(asyncio.run(serve_all(engine_for(CachedModel(model, rows=1)), [request], join_after=0))[0])


class Here:
    """A deployment's class called in this process, its methods as coroutines (as the app's
    Remote makes of a deployment handle's)."""

    def __init__(self, instance: Any) -> None:
        self.instance = instance

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.instance, name)

        async def call(*args: Any) -> Any:
            return method(*args)
        return call


def follower_of(run: Path, **args: Any) -> tuple[WeightFollower, Any]:
    """A replica's follower of `run` (as ModelServer composes one), and the app's AppWeights."""
    cfg = load_config({"checkpoint": str(run), "engine.device": "cpu", "batching.max_batch_size": 4, "follow": True,
                       "follow.interval_s": 0.1, **args}, use_gpu=False)
    metrics = ServingMetrics()
    engine = BuiltinEngine(cfg, cfg.checkpoint, read_spec(cfg.checkpoint).model, cfg.fingerprint, metrics=metrics)
    app_weights = AppWeights.func_or_class()
    app_weights.promote(Path(cfg.checkpoint))  # as a replica starting does
    gate = WeightGate(cfg, engine, served_at_start(cfg), metrics)
    return WeightFollower(cfg, gate, Here(app_weights), None, "replica-1", metrics), app_weights
