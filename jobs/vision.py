"""An image classifier, as a task of your own: a small CNN, a synthetic image dataset made in the
process (no download) and the cross-entropy loss, named by jobs/configs/vision_ddp.yaml as
`model.factory`, `data.factory` and `loss.factory`, and the accuracy it is validated by
(`metrics.factory`). Any module, map-style dataset and loss of
yours plug in the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


def small_cnn(channels: int = 16, classes: int = 10, size: int = 16) -> nn.Module:
    """Two 3x3 convolutions, each followed by a 2x2 pooling, then a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * channels * (size // 4) ** 2, classes))


class SyntheticImages(torch.utils.data.Dataset):
    """`num_samples` 3 x size x size images, each one of `classes` fixed random patterns plus
    noise, labelled with its pattern: learnable, and the same on every worker (drawn from `seed`).
    The validation split shows the same patterns with labels and noise drawn apart."""

    def __init__(self, num_samples: int = 1024, classes: int = 10, size: int = 16, noise: float = 0.5,
                 seed: int = 0, split: Literal["train", "validation"] = "train") -> None:
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(classes, 3, size, size, generator=g)
        if split == "validation":
            g.manual_seed(seed + (1 << 32))
        self.labels = torch.randint(classes, (num_samples,), generator=g)
        self.images = patterns[self.labels] + noise * torch.randn(num_samples, 3, size, size, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


def cross_entropy() -> Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The loss of the model's logits and a batch of (images, labels): the mean over its images."""
    def loss(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(logits.float(), batch[1])
    return loss


def accuracy() -> Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    """The validation metric: the fraction of a batch's images whose highest logit is their label."""
    def measure(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"accuracy": (logits.argmax(dim=-1) == batch[1]).float().mean()}
    return measure
