"""Global sample order and per-rank sharding by global position.

Training consumes one global sample order, the same on every rank: a fresh permutation of the
dataset per epoch, seeded by (seed, epoch). A run's progress is a single integer, the number of
samples consumed so far (`samples_seen`). Each optimizer step takes the next `global_batch_size`
positions and deals them out as (micro-step, rank, sample). Because the split is recomputed from
the position alone, a run resumed at another world size carries on at the exact next sample:
nothing is repeated and nothing skipped.
"""

from __future__ import annotations

import torch


class GlobalSampleOrder:
    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_samples, generator=g)
        return self._perm

    def ids(self, start: int, count: int) -> torch.Tensor:
        """Sample ids at global positions [start, start + count), crossing epochs as needed."""
        out, pos = [], start
        while pos < start + count:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(self.num_samples - offset, start + count - pos)
            out.append(self._permutation(epoch)[offset: offset + take])
            pos += take
        return torch.cat(out)


class SequentialOrder:
    """Validation: samples 0, 1, 2, ... in order, the same ones at every evaluation."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def ids(self, start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count) % self.num_samples


def micro_batch_ids(order: GlobalSampleOrder | SequentialOrder, samples_seen: int, rank: int, world_size: int,
                    micro_batch_size: int, accum_steps: int) -> list[torch.Tensor]:
    """This rank's sample ids for each micro-step of the optimizer step starting at `samples_seen`."""
    step = order.ids(samples_seen, accum_steps * world_size * micro_batch_size)
    return list(step.view(accum_steps, world_size, micro_batch_size)[:, rank])
