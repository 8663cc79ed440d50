"""Weights a training run published to a serving app through Ray's object store
(`checkpoint.publish_to`): the whole model's state dict, put once by training's rank 0; each
serving shard takes its own part of it (a pipeline stage's tensors, a tensor-parallel rank's
slices), however training split the model. No storage is read on the way."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from torch import nn

from shardyard.checkpoint.loaders import load_model_part
from shardyard.checkpoint.record import step_of
from shardyard.models import build_model, give_storage
from shardyard.models.initial_weights import copy_local
from shardyard.spec import GPTSpec, HFSpec

# The deployment of a serving app that takes published weights (serve/follow/app_weights.py): training
# finds it by this name with serve.get_deployment_handle, knowing nothing else of serving.
APP_WEIGHTS = "AppWeights"


@dataclass(frozen=True)
class Published:
    run: str
    step: int
    model: GPTSpec | HFSpec
    refs: list[ray.ObjectRef]  # one: the state dict (in a list, so that it travels as a reference)
    generation: int = 0  # the lease generation of the launch that published it: a newer one wins
    attempt: int = 0  # and the worker group of that launch (a newer group wins within a generation)
    time: float = field(default_factory=time.time)

    @property
    def writer(self) -> tuple[int, int]:
        """Who published it: (lease generation, worker group), later writers ordered after."""
        return self.generation, self.attempt

    @property
    def name(self) -> str:
        return f"{self.run}@{self.step} (published)"

    def __str__(self) -> str:
        return self.name


def load_published_part(published: Published, part: Callable[[nn.Module], nn.Module],
                        device: torch.device) -> nn.Module:
    """What `part` makes of the published model, each of its tensors (or this rank's slice of
    it, for a tensor-parallel part) copied from the published state dict."""
    state: dict[str, torch.Tensor] = ray.get(published.refs[0])
    with torch.device("meta"):
        piece = part(build_model(published.model))
    give_storage(piece, device)
    for name, target in piece.state_dict(keep_vars=True).items():
        if name not in state:
            raise KeyError(f"the weights published at {published.name} hold no '{name}'")
        copy_local(target, state[name])
    return piece.eval()


def load_source_part(source: str | Path | Published, part: Callable[[nn.Module], nn.Module], device: torch.device,
                     collective: bool = False, trust_factory: str | None = None) -> nn.Module:
    """`part` of a checkpoint (or model directory) or of published weights."""
    if isinstance(source, Published):
        return load_published_part(source, part, device)
    return load_model_part(source, part, device, collective=collective, trust_factory=trust_factory).eval()


def source_step(source: Path | Published) -> int:
    """The training step of a checkpoint directory or of published weights."""
    return source.step if isinstance(source, Published) else step_of(Path(source).name)
