"""Decode attention over the serving engine's KV cache, three ways, side by side in one run: what
models/kv_cache.py does (each sequence's keys in its lane, attended as a view in place), the
gather it replaced (every row's blocks copied into one tensor, then SDPA), and its paged
attention, FlexAttention reading the blocks in place under a block mask built from the block
tables (compiled, as it must be to run fast; vLLM's FlexAttention backend does this; the
default on GPUs). Each is one decode step of one layer:
the new token's keys and values stored, then the rows' attention.

Shapes: rows of 16 decoding sequences of ~160 positions (the serving benchmark's 128 in / 64 out)
and of ~1,000, with head_dim 64 (8 query heads on 4 key heads) and 128 (4 on 2), in bfloat16,
blocks scattered over a pool of 4,096. Reported: ms per step and each way's time over the lanes'.

    python benchmarks/kv_attention.py [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import print_table, write_json
from shardyard.models.kv_cache import KVCache
from shardyard.models.kv_layout import BLOCK_TOKENS, CacheStep

POOL_BLOCKS = 4096
SHAPES = {"hd64": dict(heads=8, kv_heads=4, head_dim=64), "hd128": dict(heads=4, kv_heads=2, head_dim=128)}
PASTS = {"~160 positions": (128, 192), "~1,000 positions": (960, 1056)}
ROWS = 16


class Step:
    """One decode step of ROWS sequences whose pasts are in the cache, in blocks and in lanes."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, past: tuple[int, int]) -> None:
        rng = random.Random(0)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.lengths = [rng.randint(*past) for _ in range(ROWS)]
        widest = -(-(max(self.lengths) + 1) // BLOCK_TOKENS)
        picked = rng.sample(range(POOL_BLOCKS), ROWS * widest)
        self.tables = tuple(tuple(picked[r * widest:(r + 1) * widest]) for r in range(ROWS))
        self.cache, self.paged = KVCache(POOL_BLOCKS), KVCache(POOL_BLOCKS, paged=True)
        for lane, (table, length) in enumerate(zip(self.tables, self.lengths)):  # each sequence's prefill
            keys = self.new(1, kv_heads, length)
            past = (self.new(1, heads, length), keys, torch.randn_like(keys))
            for cache in (self.cache, self.paged):
                cache.begin(CacheStep((table,), (0,), lanes=(lane,), held=(0,)), length, torch.device("cpu"))
                cache.attend("0", *past)
        self.q, self.k, self.v = self.new(ROWS, heads, 1), self.new(ROWS, kv_heads, 1), self.new(ROWS, kv_heads, 1)
        self.step = CacheStep(self.tables, tuple(self.lengths), lanes=tuple(range(ROWS)), held=tuple(self.lengths))

    def new(self, rows: int, heads: int, tokens: int) -> torch.Tensor:
        return torch.randn(rows, heads, tokens, self.head_dim, dtype=torch.bfloat16)

    def lanes(self) -> Callable[[], torch.Tensor]:
        """The engine's way (the step's plan made once, as once per pass for all layers)."""
        self.cache.begin(self.step, 1, torch.device("cpu"))
        return lambda: self.cache.attend("0", self.q, self.k, self.v)

    def gathered(self) -> Callable[[], torch.Tensor]:
        """The former way: the rows' blocks gathered into one tensor per layer, then attended
        (the indices made once, as once per pass)."""
        pool_keys, pool_values = self.cache.keys["0"], self.cache.values["0"]
        width = max(self.lengths) + 1
        positions = torch.arange(width)
        slots = torch.tensor(self.tables)[:, positions // BLOCK_TOKENS] * BLOCK_TOKENS + positions % BLOCK_TOKENS
        ends = torch.tensor(self.lengths)
        new_slots = slots[torch.arange(ROWS), ends]
        mask = (positions[None, :] <= ends[:, None])[:, None, None]

        def attend() -> torch.Tensor:
            pool_keys[new_slots], pool_values[new_slots] = self.k[:, :, 0], self.v[:, :, 0]
            keys, values = (pool.index_select(0, slots.flatten()).view(ROWS, width, self.kv_heads, self.head_dim)
                            .transpose(1, 2) for pool in (pool_keys, pool_values))
            grouped = self.q.reshape(ROWS, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
            return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask).reshape(self.q.shape)

        return attend

    def flex(self) -> Callable[[], torch.Tensor]:
        """The engine's paged attention (`KVCache(paged=True)`): FlexAttention over the pool as it
        lies, each row visiting its own blocks and, within them, the positions up to its own."""
        self.paged.begin(self.step, 1, torch.device("cpu"))
        return lambda: self.paged.attend("0", self.q, self.k, self.v)


def milliseconds(run: Callable[[], torch.Tensor], steps: int) -> float:
    for _ in range(10):
        run()
    started = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for shape, dims in SHAPES.items():
        for past_name, past in PASTS.items():
            step = Step(**dims, past=past)
            ways = {"lanes": step.lanes(), "gathered": step.gathered(), "flex": step.flex()}
            expected = ways["lanes"]()
            for name, run in ways.items():  # the same attention, each way
                torch.testing.assert_close(run().float(), expected.float(), rtol=0.02, atol=0.02, msg=name)
            times = {name: milliseconds(run, args.steps) for name, run in ways.items()}
            rows.append({"shape": shape, "past": past_name, "rows": ROWS, "lanes_ms": times["lanes"],
                         "gathered_ms": times["gathered"], "flex_compiled_ms": times["flex"],
                         "gathered_vs_lanes": times["gathered"] / times["lanes"],
                         "flex_vs_lanes": times["flex"] / times["lanes"]})
            print(rows[-1], flush=True)
    print_table(f"decode attention, one layer, {ROWS} rows, bfloat16, {torch.get_num_threads()} threads", rows)
    write_json("kv_attention", {"rows": rows, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
