"""A user's own module for the `model.name: custom` tests: `model.factory: "custom_model:build"`.
Token ids in, logits out; it names its repeated blocks the transformers way, so FSDP wraps each."""

from __future__ import annotations

import torch
from torch import nn

from shardyard.spec import CustomSpec


class Mixer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Causal: each position mixes in the running mean of the positions before it.
        mean = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[None, :, None]
        return x + self.down(torch.relu(self.up(self.norm(mean))))


class TinyLM(nn.Module):
    _no_split_modules = ("Mixer",)

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mixers = nn.ModuleList(Mixer(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for mixer in self.mixers:
            x = mixer(x)
        return self.head(x)


def build(spec: CustomSpec) -> nn.Module:
    return TinyLM(spec.vocab_size, spec.options.get("width", 32), spec.options.get("depth", 2))
