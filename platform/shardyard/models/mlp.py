"""A plain MLP regressor: the smallest model every strategy and the serving side can share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardyard.spec import MLPSpec


class MLP(nn.Module):
    # Blocks FSDP wraps one by one and activation checkpointing recomputes (transformers' name).
    _no_split_modules = ("Linear",)

    def __init__(self, spec: MLPSpec) -> None:
        super().__init__()
        self.spec = spec
        widths = [spec.in_dim] + [spec.hidden_dim] * spec.n_layer
        # A ModuleDict of named layers, like the GPT's blocks, so stages can drop what they skip.
        self.layers = nn.ModuleDict(
            {str(i): nn.Linear(a, b) for i, (a, b) in enumerate(zip(widths, widths[1:]))}
        )
        self.head = nn.Linear(spec.hidden_dim, spec.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = F.relu(layer(x))
        return self.head(x)


def mse_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.float(), targets)
