"""How a KV cache (models/kv_cache.py) is addressed.

A paged cache, as vLLM's: memory is a pool of fixed-size blocks (BLOCK_TOKENS positions each)
per attention layer, and a sequence's positions live in the blocks its block table names, in
order. A sequence takes blocks for what it may hold, not a whole context window, and blocks whose
tokens (and every token before them) are the same in two sequences can be one block read by both
(prefix caching).

Who decides what: the scheduler owns the blocks (serve/engine/kv_blocks.py: which are free, which hold
what, which are shared) and every forward pass carries its decision as a `CacheStep`: each row's
block table and how many of its tokens are cached already. A cache here is only the memory a
step writes and reads as it is told, so every shard of a sharded model (pipeline: its layers;
tensor: its heads) applies the same steps with nothing of its own to keep in line, and a lost
shard's cache is recovered by the scheduler forgetting what its blocks held.

Lanes (the CPU's second copy of each running sequence) are grown in powers of two.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

BLOCK_TOKENS = 16  # positions per block: vLLM's default
LANE_POSITIONS = 64  # the fewest positions a lane is grown to, and the narrowest width a padded step attends


@dataclass(frozen=True)
class CacheStep:
    """One forward pass over B rows of T new tokens each (a prompt or a chunk of one: B = 1; a
    decode step: T = 1). Row b's tokens take positions starts[b] .. starts[b] + T - 1 and go into
    the blocks tables[b] (its block i holds positions i * BLOCK_TOKENS onwards); each token
    attends over its row's positions up to its own. `lengths`: a packed pass instead, one row of
    tokens holding sequence b's lengths[b] tokens after those of the sequences before it (decode
    steps and prompt chunks in one pass, so the weights are read once for both). `lanes`: each
    row's lane, which holds its first held[b] positions already (the rest before starts[b] are
    read from its blocks into it); none named: row b's lane is b, holding nothing. `reset`:
    nothing is computed (a caller checking that a rebuilt shard group answers)."""
    tables: tuple[tuple[int, ...], ...] = ()
    starts: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    lanes: tuple[int, ...] = ()
    held: tuple[int, ...] = ()
    reset: bool = False

    def ends(self, seq: int) -> list[int]:
        """Where in a pass of `seq` tokens per row each sequence's last token is: (row, column)
        flattened, as the logits' rows and positions run."""
        if not self.lengths:
            return [row * seq + seq - 1 for row in range(len(self.tables))]
        return [end - 1 for end in accumulate(self.lengths)]


def power_of_two(n: int) -> int:
    """The smallest power of two at least `n`."""
    return 1 << (n - 1).bit_length()


def largest_lanes(running: int, positions: int) -> tuple[int, int]:
    """The most lanes, and positions each, a cache takes for `running` sequences of up to
    `positions` positions: grown to powers of two, or fixed whole with a scratch lane (`fix`)."""
    return max(power_of_two(running), running + 1), max(power_of_two(positions), LANE_POSITIONS)


def over_lanes(mask: torch.Tensor, placed: torch.Tensor, lanes: int) -> torch.Tensor:
    """Rows' masks (rows, 1, seq, W) laid over `lanes` lanes at their places; a lane no row is on
    sees its first key only (a row of nothing attended to nothing would be NaN)."""
    over = torch.zeros((lanes, *mask.shape[1:]), dtype=torch.bool, device=mask.device)
    over[..., 0] = True
    over[placed] = mask
    return over
