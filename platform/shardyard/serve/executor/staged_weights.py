"""The weights that serve and, during a swap, a candidate read beside them: how every executor (the
replica's own model, each pipeline or tensor shard) swaps weights. The served ones are kept after
a swap, so a refused candidate is swapped back without reading anything again; `drop` frees them
once the gate has judged."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardyard.checkpoint.published import Published
from shardyard.serve.executor.model_pass import all_finite

Source = str | Published


class StagedWeights:
    def __init__(self, load: Callable[[Source], torch.nn.Module]) -> None:
        self._load = load
        self.serving: torch.nn.Module | None = None
        self.other: torch.nn.Module | None = None  # the candidate before a swap, the old weights after

    def load(self, source: Source) -> torch.nn.Module:
        """The weights that serve from the start."""
        self.serving = self._load(source)
        return self.serving

    def prepare(self, source: Source) -> bool:
        """Reads a candidate beside the served weights; whether its weights are finite."""
        self.other = self._load(source)
        return all_finite(self.other)

    def swap(self) -> None:
        """The other weights serve (called between passes): a second swap puts them back."""
        if self.other is None:
            raise RuntimeError("no weights were prepared to swap in")
        self.serving, self.other = self.other, self.serving

    def drop(self) -> None:
        self.other = None
