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
attention) read it without a copy whichever transformers is installed, and so that a packed pass
(decode steps and prompt chunks of several sequences in one row of tokens) attends each sequence
over its own past: the model's other layers see only a row of tokens with their positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

BLOCK_TOKENS = 16  # positions per block: vLLM's default


@dataclass(frozen=True)
class CacheStep:
    """One forward pass over B rows of T new tokens each (a prompt or a chunk of one: B = 1; a
    decode step: T = 1). Row b's tokens take positions starts[b] .. starts[b] + T - 1 and go into
    the blocks tables[b] (its block i holds positions i * BLOCK_TOKENS onwards); each token
    attends over its row's positions up to its own. `lengths`: a packed pass instead, one row of
    tokens holding sequence b's lengths[b] tokens after those of the sequences before it (decode
    steps and prompt chunks in one pass, so the weights are read once for both). `reset`: nothing
    is computed (a caller checking that a rebuilt shard group answers)."""
    tables: tuple[tuple[int, ...], ...] = ()
    starts: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    reset: bool = False

    def ends(self, seq: int) -> list[int]:
        """Where in a pass of `seq` tokens per row each sequence's last token is: (row, column)
        flattened, as the logits' rows and positions run."""
        if not self.lengths:
            return [row * seq + seq - 1 for row in range(len(self.tables))]
        return [end - 1 for end in accumulate(self.lengths)]


@dataclass(frozen=True)
class _Group:
    """Rows of a pass that attend together, as one batch: `rows` rows of `seq` new tokens."""
    rows: int
    seq: int
    gather: torch.Tensor | None    # (rows, W) pool slot of each row's positions 0 .. W-1; None: no past
    mask: torch.Tensor             # (rows or 1, 1, seq, W) which keys each new token attends to


@dataclass(frozen=True)
class _Plan:
    """A step's index arithmetic, done once for all of a shard's layers."""
    slots: torch.Tensor            # (tokens,) pool slot of each new token
    positions: torch.Tensor        # (B, T) position ids of the new tokens
    groups: tuple[_Group, ...]     # one for B rows of T tokens; packed: each run of decode steps, each chunk
    packed: bool
    ends: torch.Tensor             # (sequences,) where each sequence's last new token is in the flattened pass


class KVCache:
    def __init__(self, blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.blocks, self.block_tokens = blocks, block_tokens
        self.keys: dict[str, torch.Tensor] = {}    # layer name -> (blocks * block_tokens, heads, head_dim)
        self.values: dict[str, torch.Tensor] = {}
        self.plan: _Plan | None = None
        self.past = 0  # the longest row's cached positions before this step
        self._gathered: list[torch.Tensor] = []  # memory the gathered keys and values are read into

    def begin(self, step: CacheStep, seq: int, device: torch.device) -> None:
        """Start a forward pass of `seq` new tokens per row (a packed pass: in its one row): check
        that the step fits, and work out where its tokens go and what each attends to."""
        if len(step.tables) != len(step.starts) or not step.tables:
            raise RuntimeError(f"a cache step needs a block table and a start per row: {step}")
        lengths = step.lengths or (seq,) * len(step.tables)
        if step.lengths and (len(lengths) != len(step.tables) or sum(lengths) != seq or min(lengths) < 1):
            raise RuntimeError(f"a packed step's lengths {lengths} do not cover its {seq} tokens, one per row")
        for table, start, length in zip(step.tables, step.starts, lengths):
            if len(table) * self.block_tokens < start + length:
                raise RuntimeError(f"a row's {len(table)} blocks hold {len(table) * self.block_tokens} positions; "
                                   f"the step writes up to position {start + length - 1}")
            if any(not 0 <= block < self.blocks for block in table):
                raise RuntimeError(f"a block table names blocks outside the cache's {self.blocks}: {table}")
        self.past = max(step.starts)
        ends = torch.tensor(step.ends(seq), device=device)
        if not step.lengths:
            slots, positions, group = self._group(step.tables, step.starts, seq, device)
            self.plan = _Plan(slots, positions, (group,), packed=False, ends=ends)
            return
        # Decode steps (one token each) attend as one batch; each longer chunk attends alone.
        spans, at = [], 0
        while at < len(lengths):
            end = at + 1
            while lengths[at] == 1 and end < len(lengths) and lengths[end] == 1:
                end += 1
            spans.append((at, end))
            at = end
        planned = [self._group(step.tables[a:b], step.starts[a:b], lengths[a], device) for a, b in spans]
        self.plan = _Plan(torch.cat([slots for slots, _, _ in planned]),
                          torch.cat([positions.flatten() for _, positions, _ in planned])[None],
                          tuple(group for _, _, group in planned), packed=True, ends=ends)

    def _group(self, tables: tuple[tuple[int, ...], ...], starts: tuple[int, ...], seq: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, _Group]:
        """Slots and positions of rows of `seq` new tokens each, and how they attend."""
        size = self.block_tokens
        width = max(len(table) for table in tables)
        table = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], device=device)
        first = torch.tensor(starts, device=device)
        positions = first[:, None] + torch.arange(seq, device=device)[None, :]
        slots = (table.gather(1, positions // size) * size + positions % size).flatten()
        past = max(starts)
        if past == 0:  # every row new: its keys are this pass's own, under a causal mask
            mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]
            return slots, positions, _Group(len(tables), seq, None, mask)
        keys = torch.arange(past + seq, device=device)
        # Past a row's own table the index falls on padding (block 0): masked like any later position.
        gather = table[:, (keys // size).clamp(max=width - 1)] * size + keys % size
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
        return slots, positions, _Group(len(tables), seq, gather, mask)

    def last_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each sequence's last new token of this pass's (B, T, D) hidden states, as (sequences, 1, D):
        the only positions whose logits the engine reads (a prompt's others would cost the head's
        product for nothing, a third of a small model's weights at a 32,000-token vocabulary)."""
        return hidden.flatten(0, 1)[self.plan.ends][:, None]

    def logits_to_keep(self) -> int | torch.Tensor:
        """The same positions as transformers' `logits_to_keep` takes them: the last column of every
        row, or, in a packed pass (one row), each sequence's column. The logits come back (B, 1, V)
        or (1, sequences, V): `last_logits` makes either (sequences, 1, V)."""
        return self.plan.ends if self.plan.packed else 1

    def last_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.transpose(0, 1) if self.plan.packed else logits

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """Position ids of this pass's tokens (B, T)."""
        return self.plan.positions

    def attention_mask(self, seq: int, device: torch.device) -> torch.Tensor:
        """This pass's boolean attention mask over the keys `update` returns."""
        self._not_packed()
        return self.plan.groups[0].mask

    def _not_packed(self) -> None:
        if self.plan.packed:
            raise RuntimeError("a packed pass is attended by the cache (`attend`); this model attends itself")

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """Store this pass's keys and values (B, kv_heads, T, head_dim) for `layer`, and return
        the attention (B, heads, T, head_dim) of its queries (B, heads, T, head_dim; heads a
        multiple of kv_heads) over each row's positions up to its own; in a packed pass (B = 1)
        each sequence's tokens over its own positions."""
        self._store(layer, k, v)
        if not self.plan.packed:
            return self._attend_group(layer, self.plan.groups[0], q, k, v, scale)
        out, at = [], 0
        for group in self.plan.groups:  # in token order: each group's tokens follow the one's before
            span = group.rows * group.seq

            def rows(t: torch.Tensor) -> torch.Tensor:  # (1, heads, span, D) -> (rows, heads, seq, D)
                return t[0, :, at:at + span].unflatten(1, (group.rows, group.seq)).transpose(0, 1)

            attended = self._attend_group(layer, group, rows(q), rows(k), rows(v), scale)
            out.append(attended.transpose(0, 1).flatten(1, 2))
            at += span
        return torch.cat(out, dim=1)[None]

    def _attend_group(self, layer: str, group: _Group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
        keys, values = self._past(layer, group, k, v)
        batch, heads, seq, head_dim = q.shape
        kv_heads = k.shape[1]
        if seq == 1:  # decode steps: each key head's query group is its query length, under the row's mask
            grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.mask, scale=scale)
            return out.reshape(batch, heads, 1, head_dim)
        if heads != kv_heads:
            keys, values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, scale=scale)

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's keys and values (B, heads, T, head_dim) for `layer`; return the keys
        and values to attend over, under `attention_mask` (for a model whose attention is its own;
        not in a packed pass). What it returns for one layer is overwritten by the next layer's
        call: attention reads it before then."""
        self._not_packed()
        self._store(layer, k, v)
        return self._past(layer, self.plan.groups[0], k, v)

    def _store(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> None:
        batch, heads, seq, head_dim = k.shape
        if layer not in self.keys:  # the layer's (local) head count is known at its first call
            shape = (self.blocks * self.block_tokens, heads, head_dim)
            self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        for pool, new in ((self.keys[layer], k), (self.values[layer], v)):
            pool[self.plan.slots] = new.transpose(1, 2).reshape(batch * seq, heads, head_dim)

    def _past(self, layer: str, group: _Group, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's keys and values (its rows' new ones stored already) over its rows' positions."""
        if group.gather is None:
            return k, v
        out = []
        for which, pool in enumerate((self.keys[layer], self.values[layer])):
            heads, head_dim = pool.shape[1:]
            width = group.gather.shape[1]
            gathered = self._reused(which, pool, group.rows * width * heads * head_dim).view(-1, heads, head_dim)
            torch.index_select(pool, 0, group.gather.flatten(), out=gathered)
            out.append(gathered.view(group.rows, width, heads, head_dim).transpose(1, 2))
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
