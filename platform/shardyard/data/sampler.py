"""Global sample order and per-rank sharding by global position.

Training consumes one global sample order, the same on every rank: a fresh pseudo-random
permutation of the dataset per epoch, seeded by (seed, epoch). A run's progress is a single
integer, the number of samples consumed so far (`samples_seen`). Each optimizer step takes the next
`global_batch_size` positions and deals them out as (micro-step, rank, sample). Because the split is
recomputed from the position alone, a run resumed at another world size carries on at the exact
next sample: nothing is repeated and nothing skipped.

The permutation is computed position by position (a Feistel network over the smallest square
power-of-two domain that holds the dataset, walking out-of-range values back in), never stored:
a rank's memory does not grow with the dataset (a stored permutation of a 10 GB token dataset
would cost each rank hundreds of MB).
"""

from __future__ import annotations

import numpy as np
import torch

_ROUNDS = 4
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit reaches every output bit (uint64, wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * _M2
    x = (x ^ (x >> np.uint64(27))) * _M1
    return x ^ (x >> np.uint64(31))


def feistel_permutation(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The image of `positions` (all in [0, n)) under a pseudo-random permutation of [0, n) chosen by `seed`."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2 x half bits hold every value below n
    mask = np.uint64((1 << half) - 1)
    out = np.asarray(positions, dtype=np.uint64).copy()
    walking = np.ones(len(out), dtype=bool)
    with np.errstate(over="ignore"):  # the mixing arithmetic wraps modulo 2**64 on purpose
        keys = _mix(np.arange(1, _ROUNDS + 1, dtype=np.uint64) + np.uint64(seed % 2**64) * _M1)
        while walking.any():  # cycle walking: a value outside [0, n) goes round again
            left, right = out[walking] >> np.uint64(half), out[walking] & mask
            for key in keys:
                left, right = right, left ^ (_mix(right ^ key) & mask)
            out[walking] = (left << np.uint64(half)) | right
            walking[walking] = out[walking] >= np.uint64(n)
    return out.astype(np.int64)


class GlobalSampleOrder:
    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed

    def ids(self, start: int, count: int) -> torch.Tensor:
        """Sample ids at global positions [start, start + count), crossing epochs as needed."""
        out, pos = [], start
        while pos < start + count:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(self.num_samples - offset, start + count - pos)
            offsets = np.arange(offset, offset + take, dtype=np.uint64)
            out.append(feistel_permutation(offsets, self.num_samples, self.seed * 1_000_003 + epoch))
            pos += take
        return torch.from_numpy(np.concatenate(out))


class SequentialOrder:
    """Samples 0, 1, 2, ... in order: validation's, the same ones at every evaluation, and a
    stream's own order (`num_samples` None: positions without end)."""

    def __init__(self, num_samples: int | None) -> None:
        self.num_samples = num_samples

    def ids(self, start: int, count: int) -> torch.Tensor:
        ids = torch.arange(start, start + count)
        return ids if self.num_samples is None else ids % self.num_samples


def micro_batch_ids(order: GlobalSampleOrder | SequentialOrder, samples_seen: int, rank: int, world_size: int,
                    micro_batch_size: int, accum_steps: int) -> list[torch.Tensor]:
    """This rank's sample ids for each micro-step of the optimizer step starting at `samples_seen`."""
    step = order.ids(samples_seen, accum_steps * world_size * micro_batch_size)
    return list(step.view(accum_steps, world_size, micro_batch_size)[:, rank])
