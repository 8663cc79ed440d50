"""Reference models, built from the `model` section of a job spec."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardyard.models.gpt import GPT, lm_loss
from shardyard.models.mlp import MLP, mse_loss
from shardyard.spec import GPTSpec, MLPSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_model(spec: GPTSpec | MLPSpec) -> nn.Module:
    return GPT(spec) if isinstance(spec, GPTSpec) else MLP(spec)


def loss_fn_for(spec: GPTSpec | MLPSpec) -> LossFn:
    return lm_loss if isinstance(spec, GPTSpec) else mse_loss


__all__ = ["GPT", "MLP", "LossFn", "build_model", "loss_fn_for"]
