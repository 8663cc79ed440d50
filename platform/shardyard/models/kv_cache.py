"""The keys and values of every sequence being decoded, so that a new token attends to the past
without recomputing it: the cost of a decode step no longer grows with the context (beyond
attention reading the cached keys).

A paged cache, as vLLM's: memory is a pool of fixed-size blocks (BLOCK_TOKENS positions each)
per attention layer, and a sequence's positions live in the blocks its block table names, in
order. A sequence takes blocks for what it may hold, not a whole context window, and blocks whose
tokens (and every token before them) are the same in two sequences can be one block read by both
(prefix caching).

Who decides what: the scheduler owns the blocks (serve/kv_blocks.py: which are free, which hold
what, which are shared) and every forward pass carries its decision as a `CacheStep`: each row's
block table and how many of its tokens are cached already. A cache here is only the memory a
step writes and reads as it is told, so every shard of a sharded model (pipeline: its layers;
tensor: its heads) applies the same steps with nothing of its own to keep in line, and a lost
shard's cache is recovered by the scheduler forgetting what its blocks held.

Pure PyTorch has no paged attention kernel: attention reads a row's blocks gathered into one
tensor per layer (memory kept from pass to pass), a copy the size of what attention reads anyway.
(Reading each row in place, row by row, was slower in the engine on this CPU: many small
products instead of one batched kernel.)
The cache attends itself (`attend`), so that query heads sharing a key head (grouped-query
attention) read it without a copy whichever transformers is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK_TOKENS = 16  # positions per block: vLLM's default


@dataclass(frozen=True)
class CacheStep:
    """One forward pass over B rows of T new tokens each (a prompt or a chunk of one: B = 1; a
    decode step: T = 1). Row b's tokens take positions starts[b] .. starts[b] + T - 1 and go into
    the blocks tables[b] (its block i holds positions i * BLOCK_TOKENS onwards); each token
    attends over its row's positions up to its own. `reset`: nothing is computed (a caller
    checking that a rebuilt shard group answers)."""
    tables: tuple[tuple[int, ...], ...] = ()
    starts: tuple[int, ...] = ()
    reset: bool = False


@dataclass(frozen=True)
class _Plan:
    """A step's index arithmetic, done once for all of a shard's layers."""
    slots: torch.Tensor            # (B * T,) pool slot of each new token
    gather: torch.Tensor | None    # (B, W) pool slot of each row's positions 0 .. W-1; None: no past
    positions: torch.Tensor        # (B, T) position ids of the new tokens
    mask: torch.Tensor             # (B or 1, 1, T, W) which keys each new token attends to


class KVCache:
    def __init__(self, blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.blocks, self.block_tokens = blocks, block_tokens
        self.keys: dict[str, torch.Tensor] = {}    # layer name -> (blocks * block_tokens, heads, head_dim)
        self.values: dict[str, torch.Tensor] = {}
        self.plan: _Plan | None = None
        self.past = 0  # the longest row's cached positions before this step
        self._gathered: list[torch.Tensor] = []  # memory the gathered keys and values are read into

    def begin(self, step: CacheStep, seq: int, device: torch.device) -> None:
        """Start a forward pass of `seq` new tokens per row: check that the step fits, and work
        out where its tokens go and what each attends to."""
        if len(step.tables) != len(step.starts) or not step.tables:
            raise RuntimeError(f"a cache step needs a block table and a start per row: {step}")
        size = self.block_tokens
        for table, start in zip(step.tables, step.starts):
            if len(table) * size < start + seq:
                raise RuntimeError(f"a row's {len(table)} blocks hold {len(table) * size} positions; the step "
                                   f"writes up to position {start + seq - 1}")
            if any(not 0 <= block < self.blocks for block in table):
                raise RuntimeError(f"a block table names blocks outside the cache's {self.blocks}: {table}")
        width = max(len(table) for table in step.tables)
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in step.tables], device=device)
        starts = torch.tensor(step.starts, device=device)
        positions = starts[:, None] + torch.arange(seq, device=device)[None, :]
        slots = (tables.gather(1, positions // size) * size + positions % size).flatten()
        self.past = max(step.starts)
        if self.past == 0:  # every row new: its keys are this pass's own, under a causal mask
            mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]
            self.plan = _Plan(slots, None, positions, mask)
            return
        keys = torch.arange(self.past + seq, device=device)
        # Past a row's own table the index falls on padding (block 0): masked like any later position.
        gather = tables[:, (keys // size).clamp(max=width - 1)] * size + keys % size
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
        self.plan = _Plan(slots, gather, positions, mask)

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """Position ids of this pass's tokens (B, T)."""
        return self.plan.positions

    def attention_mask(self, seq: int, device: torch.device) -> torch.Tensor:
        """This pass's boolean attention mask over the keys `update` returns."""
        return self.plan.mask

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """Store this pass's keys and values (B, kv_heads, T, head_dim) for `layer`, and return
        the attention (B, heads, T, head_dim) of its queries (B, heads, T, head_dim; heads a
        multiple of kv_heads) over each row's positions up to its own."""
        keys, values = self.update(layer, k, v)
        batch, heads, seq, head_dim = q.shape
        kv_heads = k.shape[1]
        if seq == 1:  # a decode step: each key head's query group is its query length, under the row's mask
            grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.plan.mask, scale=scale)
            return out.reshape(batch, heads, 1, head_dim)
        if heads != kv_heads:
            keys, values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.plan.mask, scale=scale)

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's keys and values (B, heads, T, head_dim) for `layer`; return the keys
        and values to attend over, under `attention_mask` (what `attend` does first; a model whose
        attention is its own calls it alone). What it returns for one layer is overwritten by the
        next layer's call: attention reads it before then."""
        batch, heads, seq, head_dim = k.shape
        if layer not in self.keys:  # the layer's (local) head count is known at its first call
            shape = (self.blocks * self.block_tokens, heads, head_dim)
            self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        plan, out = self.plan, []
        for which, (pool, new) in enumerate(((self.keys[layer], k), (self.values[layer], v))):
            pool[plan.slots] = new.transpose(1, 2).reshape(batch * seq, heads, head_dim)
            if plan.gather is None:
                out.append(new)
            else:
                width = plan.gather.shape[1]
                gathered = self._reused(which, pool, batch * width * heads * head_dim).view(batch * width, heads, head_dim)
                torch.index_select(pool, 0, plan.gather.flatten(), out=gathered)
                out.append(gathered.view(batch, width, heads, head_dim).transpose(1, 2))
        return out[0], out[1]

    def _reused(self, which: int, like: torch.Tensor, size: int) -> torch.Tensor:
        """`size` elements of memory kept from pass to pass (grown when a pass needs more). Why:
        a fresh tensor the size of a decode step's gathered past is mapped from the system page by
        page every time (glibc serves large allocations so), which took longer than the gather
        itself: 16 of 44 ms of a 16-row decode pass of the benchmark's Llama on this CPU."""
        if len(self._gathered) <= which:
            self._gathered.append(like.new_empty(0))
        buffer = self._gathered[which]
        if buffer.numel() < size or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._gathered[which] = like.new_empty(size)
        return buffer[:size]
