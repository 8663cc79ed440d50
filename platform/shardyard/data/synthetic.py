"""Synthetic datasets for tests and benchmarks: generated from a seed, learnable, tiny to hold."""

from __future__ import annotations

import torch


class SyntheticTokens:
    """Arithmetic token sequences (start + stride * t mod vocab): a GPT can learn to continue them."""

    def __init__(self, num_samples: int, block_size: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab_size, (num_samples, 1), generator=g)
        stride = torch.randint(1, 8, (num_samples, 1), generator=g)
        self.rows = (start + stride * torch.arange(block_size + 1)) % vocab_size

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows[ids]
        return rows[:, :-1], rows[:, 1:]


class SyntheticRegression:
    """Inputs x ~ N(0, I) and targets from a fixed random two-layer teacher network."""

    def __init__(self, num_samples: int, in_dim: int, out_dim: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, in_dim, generator=g)
        w1 = torch.randn(in_dim, 4 * out_dim, generator=g) / in_dim**0.5
        w2 = torch.randn(4 * out_dim, out_dim, generator=g) / (4 * out_dim) ** 0.5
        self.y = torch.tanh(self.x @ w1) @ w2

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[ids], self.y[ids]
