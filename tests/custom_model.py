"""A user's own modules for the `model.name: custom` tests: `model.factory: "custom_model:build"`.
Token ids in, logits out; they name their repeated blocks the transformers way, so FSDP wraps each.
`build_splittable` adds the hooks tensor and pipeline parallelism need (models/stages.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardyard.models.stages import PipelineLayout
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
        self.embed: nn.Embedding | None = nn.Embedding(vocab, width)
        # A dict keyed by depth, so a pipeline stage keeps the whole model's parameter names.
        self.mixers = nn.ModuleDict({str(i): Mixer(width) for i in range(depth)})
        self.head: nn.Linear | None = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for mixer in self.mixers.values():
            x = mixer(x)
        return x if self.head is None else self.head(x)


class SplittableLM(TinyLM):
    """TinyLM with the hooks: a Megatron pair per mixer, and stages of consecutive mixers."""

    block_tp_plan = {"up": "colwise", "down": "rowwise"}

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(first=[self.embed], blocks=list(self.mixers.values()), last=[self.head])

    def pipeline_stage(self, start: int, end: int) -> SplittableLM:
        stage = copy.deepcopy(self)
        for name in [k for k in stage.mixers if not start <= int(k) < end]:
            del stage.mixers[name]
        if start > 0:
            stage.embed = None
        if end < len(self.mixers):
            stage.head = None
        return stage


def build(spec: CustomSpec) -> nn.Module:
    return TinyLM(spec.vocab_size, spec.options.get("width", 32), spec.options.get("depth", 2))


def build_splittable(spec: CustomSpec) -> nn.Module:
    model = SplittableLM(spec.vocab_size, spec.options.get("width", 32), spec.options.get("depth", 2))
    if "tp_plan" in spec.options:  # a plan of the user's (the refusal tests give wrong ones)
        model.block_tp_plan = spec.options["tp_plan"]
    return model
