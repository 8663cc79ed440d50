"""Paged attention: FlexAttention reads every row's keys and values from the KV cache's blocks
where they lie (models/kv_cache.py, `paged`), under a block mask made from the step's block tables:
each row visits its own blocks, and within them the positions up to each token's own. Nothing else
holds the keys and values (the lanes, the CPU's default, keep a second copy per sequence).

On GPUs FlexAttention's kernel is the one vLLM's FlexAttention backend runs, with 16x16 tiles.
On CPUs, torch 2.13's Inductor C++ kernel needs three workarounds, each said where it is made: a
graph per shape (`_compiled_flex_attention`), a second query for a decode step and rows of block
indices as wide as the pool (`block_mask`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from itertools import chain

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def positions_of_blocks(tables: tuple[tuple[int, ...], ...], pool_blocks: int, device: torch.device) -> torch.Tensor:
    """Each block's index in the tables that name it (-1: none does), one for the pool (and its
    scratch block): a block two sequences share (a cached prefix) is at the same index in both,
    as its tokens and all before them are the same. Made on the CPU in a few tensor operations
    (a step may name thousands of blocks), then moved at once."""
    blocks = torch.tensor(list(chain.from_iterable(tables)), dtype=torch.long)
    lengths = torch.tensor([len(table) for table in tables])
    index = torch.arange(blocks.numel()) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
    found = torch.full((pool_blocks,), -1, dtype=torch.long)
    found[blocks] = index  # where a block is named twice, either index lands: checked next
    if (wrong := (found[blocks] != index).nonzero()).numel():
        at = int(wrong[0, 0])
        raise RuntimeError(f"block {int(blocks[at])} is at two indices of the step's tables: "
                           f"{sorted({int(index[at]), int(found[blocks[at]])})}")
    return found.to(device, non_blocking=True)


def block_mask(table: torch.Tensor, first: torch.Tensor, seq: int, positions_of_blocks: torch.Tensor,
               block_tokens: int, pool_slots: int) -> BlockMask:
    """FlexAttention's block mask for rows of `seq` new tokens starting at `first` (rows,):
    each block of BLOCK_TOKENS queries of row b visits row b's blocks up to its last token's
    (the pool's slots are the keys), and within them the positions up to each token's own."""
    size, (rows, width) = block_tokens, table.shape
    # On CPUs a decode step is given a second query (a copy, whose output is dropped): Inductor's
    # C++ kernel for one query a row over a large pool did not build (torch 2.13).
    queries = 2 if seq == 1 and table.device.type == "cpu" else seq
    query_blocks = -(-queries // size)
    ends = torch.arange(1, query_blocks + 1, device=table.device).mul(size).clamp(max=queries)
    counts = (first[:, None] + ends[None, :] - 1) // size + 1
    slots = pool_slots
    # Inductor's CPU kernel takes a row of indices as wide as the pool (its blocks after a row's
    # own are never visited); a GPU's only as wide as the longest table.
    wide = slots // size if table.device.type == "cpu" else width
    indices = F.pad(table.clamp(min=0), (0, wide - width))[:, None, None, :].expand(rows, 1, query_blocks, wide)

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        # The mask alone decides (an eager pass computes every slot): the slot's block is the
        # row's own, at an index whose positions the token may see.
        block = kv // size
        index = positions_of_blocks[block]
        owned = (index >= 0) & (table[b, index.clamp(0, width - 1)] == block)
        return owned & (index * size + kv % size <= first[b] + q)

    return BlockMask.from_kv_blocks(counts[:, None].to(torch.int32), indices.to(torch.int32).contiguous(),
                                    BLOCK_SIZE=(size, size), mask_mod=visible, seq_lengths=(queries, slots),
                                    compute_q_blocks=False)


def attend_blocks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: BlockMask, block_tokens: int,
                  scale: float | None) -> torch.Tensor:
    """FlexAttention of rows of queries (rows, heads, seq, head_dim) over a layer's pool as it lies
    (`keys`, `values`: one batch of slots, read by every row under the block mask `blocks`). Compiled outside a compiled
    pass: FlexAttention's eager form computes every slot's score."""
    attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention(q.device.type)
    # On GPUs the kernel's tiles are the mask's (16 queries by a block): vLLM's choice.
    options = ({"BACKEND": "TRITON", "BLOCK_M": block_tokens, "BLOCK_N": block_tokens}
               if q.device.type == "cuda" else None)
    seq = q.shape[2]
    if blocks.shape[-2] > seq:  # a CPU's decode step: its second query (`block_mask`)
        q = q.expand(-1, -1, blocks.shape[-2], -1)
    out = attend(q, keys, values, block_mask=blocks, scale=scale, enable_gqa=q.shape[1] != keys.shape[1],
                 kernel_options=options)
    return out[:, :, :seq]


@cache
def _compiled_flex_attention(device: str) -> Callable:
    """FlexAttention compiled once for the process. On GPUs its shapes as the compiler's default
    takes them (dynamic from the second); on CPUs a graph per shape: Inductor's C++ kernel for it
    failed to build with dynamic shapes (torch 2.13), so paged attention there compiles for each
    new (rows, tokens) and, past the compiler's recompile limit, runs eagerly (every slot's score)."""
    return torch.compile(flex_attention, dynamic=None if device == "cuda" else False)
