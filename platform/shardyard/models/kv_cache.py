"""The keys and values of every sequence being decoded, so that a new token attends to the past
without recomputing it: the cost of a decode step no longer grows with the context (beyond
attention reading the cached keys).

Memory is a pool of blocks per layer, addressed as models/kv_layout.py says; the scheduler decides
what each pass writes and reads, and the cache does as it is told.

Attention reads the past one of two ways, chosen when the cache is made (`paged`):
- paged (the default on GPUs): attention reads every row's keys and values from its blocks where
  they lie (models/paged_attention.py). Nothing else holds them.
- lanes (the default on CPUs, where it measured faster): each running sequence also has a lane, a
  row of positions in one tensor per layer (lanes x kv heads x positions x head_dim), which every
  step appends its new keys and values to, beside its blocks. A batch of rows attends over a view
  of consecutive lanes, in place: a decode step copies its new token, not the sequence's past. A
  lane is filled from its sequence's blocks only where the step says it does not hold them yet
  (`CacheStep.held`: a sequence new to its lane, whose prefix was found cached; a caller that
  names no lanes gets every row's past read from the blocks each step). The lanes cost memory: at
  most the running sequences' positions again, twice (keys, values).
benchmarks/kv_attention.py measures the choices side by side: on a 2-core CPU the blocks gathered
into a tensor and attended took 1.5-1.8x the lanes' time, paged attention 4.9-6.7x.
The cache attends itself (`attend`), so that query heads sharing a key head (grouped-query
attention) read it without a copy whichever transformers is installed, and so that a packed pass
(decode steps and prompt chunks of several sequences in one row of tokens) attends each sequence
over its own past: the model's other layers see only a row of tokens with their positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from shardyard.models.kv_layout import BLOCK_TOKENS, LANE_POSITIONS, CacheStep, over_lanes, power_of_two
from shardyard.models.paged_attention import attend_blocks, block_mask, positions_of_blocks

@dataclass(frozen=True)
class _Group:
    """Rows of a pass that attend together, as one batch: `rows` rows of `seq` new tokens."""
    rows: int
    seq: int
    lanes: slice | torch.Tensor | None  # the lanes its rows' keys are read from (a tensor: copied out, in row
    #                                     order); None: no past, this pass's own
    placed: torch.Tensor | None    # each row's index among those lanes; None: row b is the b-th
    mask: torch.Tensor             # (rows or 1, 1, seq, W) which keys each new token attends to
    lane_mask: torch.Tensor | None  # the same over the lanes (where rows are placed): an idle lane sees its first key
    blocks: BlockMask | None = None  # paged: what each row's tokens read from the pool, where it lies
    past_slots: torch.Tensor | None = None  # paged: (rows, W) pool slot of each row's positions, for `update`


@dataclass(frozen=True)
class _Fill:
    """Positions a lane does not hold yet, read from the blocks before the step writes."""
    lane: int
    first: int
    slots: torch.Tensor            # pool slot of each position first, first + 1, ...


@dataclass(frozen=True)
class _Plan:
    """A step's index arithmetic, done once for all of a shard's layers."""
    slots: torch.Tensor            # (tokens,) pool slot of each new token
    positions: torch.Tensor        # (B, T) position ids of the new tokens
    token_lanes: torch.Tensor      # (tokens,) the lane of each new token
    groups: tuple[_Group, ...]     # one for B rows of T tokens; packed: each run of decode steps, each chunk
    packed: bool
    ends: torch.Tensor             # (sequences,) where each sequence's last new token is in the flattened pass
    fills: tuple[_Fill, ...]
    lanes: int                     # lanes the step needs
    width: int                     # positions a lane needs


class KVCache:
    def __init__(self, blocks: int, block_tokens: int = BLOCK_TOKENS, paged: bool = False) -> None:
        """`paged`: attention reads the blocks in place (FlexAttention), and there are no lanes."""
        self.blocks, self.block_tokens, self.paged = blocks, block_tokens, paged
        self.keys: dict[str, torch.Tensor] = {}    # layer name -> (blocks * block_tokens, heads, head_dim)
        self.values: dict[str, torch.Tensor] = {}
        self.lane_keys: dict[str, torch.Tensor] = {}  # layer name -> (lanes, heads, positions, head_dim)
        self.lane_values: dict[str, torch.Tensor] = {}
        self.plan: _Plan | None = None
        self.past = 0  # the longest row's cached positions before this step
        self.fixed: tuple[int, int] | None = None  # (lanes, positions) allocated whole: `fix`
        # Seconds spent in `attend` (storing and attending) on a CPU, eager passes only: a GPU's
        # kernels run asynchronously and a compiled pass cannot be timed inside.
        self.attention_s = 0.0

    def fix(self, lanes: int, positions: int) -> None:
        """Allocate every layer's lanes whole (`lanes` of `positions`, and one scratch lane) and the
        blocks with one scratch block, at their first use, never to move: what a compiled decode
        step reads and writes through the same tensors every time (`begin`'s `pad_to`), and a
        CUDA graph replays over the same addresses. Before the cache's first pass."""
        if self.keys:
            raise RuntimeError("a KV cache is fixed before its first pass")
        self.fixed = (lanes, positions)

    def takes_padded(self, step: CacheStep, seq: int) -> bool:
        """Whether `begin` can pad this step: a fixed cache, a decode step (one token a row, not
        packed) whose rows' lanes hold their pasts and fit."""
        return (self.fixed is not None and seq == 1 and not step.lengths and bool(step.lanes)
                and step.held == step.starts and max(step.lanes) < self.fixed[0]
                and max(step.starts) < self.fixed[1])

    def begin(self, step: CacheStep, seq: int, device: torch.device, pad_to: int = 0) -> None:
        """Start a forward pass of `seq` new tokens per row (a packed pass: in its one row): check
        that the step fits, and work out where its tokens go and what each attends to. `pad_to`:
        a decode step (`takes_padded`) of `pad_to` rows, its own and then rows of nothing, shaped
        by the row count and the width attended only (for a compiled pass)."""
        if len(step.tables) != len(step.starts) or not step.tables:
            raise RuntimeError(f"a cache step needs a block table and a start per row: {step}")
        lengths = step.lengths or (seq,) * len(step.tables)
        if step.lengths and (len(lengths) != len(step.tables) or sum(lengths) != seq or min(lengths) < 1):
            raise RuntimeError(f"a packed step's lengths {lengths} do not cover its {seq} tokens, one per row")
        lanes, held = step.lanes or tuple(range(len(step.tables))), step.held or (0,) * len(step.tables)
        if len(lanes) != len(step.tables) or len(held) != len(lanes) or len(set(lanes)) != len(lanes) or min(lanes) < 0:
            raise RuntimeError(f"a cache step needs a lane of its own and what it holds per row: {step}")
        for table, start, length, holds in zip(step.tables, step.starts, lengths, held):
            if len(table) * self.block_tokens < start + length:
                raise RuntimeError(f"a row's {len(table)} blocks hold {len(table) * self.block_tokens} positions; "
                                   f"the step writes up to position {start + length - 1}")
            if any(not 0 <= block < self.blocks for block in table):
                raise RuntimeError(f"a block table names blocks outside the cache's {self.blocks}: {table}")
            if not 0 <= holds <= start:
                raise RuntimeError(f"a lane cannot hold {holds} positions of a row starting at {start}")
        self.past = max(step.starts)
        if pad_to:
            self.plan = self._padded(step, pad_to, device)
            return
        fills = () if self.paged else tuple(
            self._fill(lane, table, holds, start, device)
            for lane, table, holds, start in zip(lanes, step.tables, held, step.starts) if holds < start)
        block_indices = positions_of_blocks(step.tables, self.blocks + 1, device) if self.paged else None
        common = dict(ends=torch.tensor(step.ends(seq), device=device), fills=fills, lanes=max(lanes) + 1,
                      width=max(start + length for start, length in zip(step.starts, lengths)),
                      token_lanes=torch.tensor(lanes, device=device).repeat_interleave(
                          torch.tensor(lengths, device=device)))
        if not step.lengths:
            slots, positions, group = self._group(step.tables, step.starts, lanes, seq, device, block_indices)
            self.plan = _Plan(slots, positions, groups=(group,), packed=False, **common)
            return
        # Decode steps (one token each) attend as one batch; each longer chunk attends alone.
        spans, at = [], 0
        while at < len(lengths):
            end = at + 1
            while lengths[at] == 1 and end < len(lengths) and lengths[end] == 1:
                end += 1
            spans.append((at, end))
            at = end
        planned = [self._group(step.tables[a:b], step.starts[a:b], lanes[a:b], lengths[a], device, block_indices)
                   for a, b in spans]
        self.plan = _Plan(torch.cat([slots for slots, _, _ in planned]),
                          torch.cat([positions.flatten() for _, positions, _ in planned])[None],
                          groups=tuple(group for _, _, group in planned), packed=True, **common)

    def _padded(self, step: CacheStep, rows: int, device: torch.device) -> _Plan:
        """A decode step as `rows` rows over every lane (each row's queries at its lane), keys up
        to a power-of-two width: the plan's tensors are shaped by `rows` and the width only. The
        padding rows write their key to the scratch block and lane and attend to it alone."""
        if not self.takes_padded(step, 1) or rows < len(step.tables):
            raise RuntimeError(f"a padded step is a decode step over a fixed cache's lanes, at most {rows} rows")
        lanes, positions = self.fixed
        size, pads = self.block_tokens, rows - len(step.tables)
        starts = torch.tensor(step.starts + (0,) * pads, device=device)
        slots = [table[start // size] * size + start % size for table, start in zip(step.tables, step.starts)]
        width = min(positions, power_of_two(max(LANE_POSITIONS, self.past + 1)))
        keys = torch.arange(width, device=device)
        mask = (keys[None, :] <= starts[:, None])[:, None, None]
        placed = torch.tensor(step.lanes + (lanes,) * pads, device=device)
        if self.paged:  # each row's own blocks, at the width of the longest context: one shape per row count
            tables = step.tables + ((self.blocks,),) * pads  # a padding row reads its key in the scratch block
            table = self._table(tables, -(-positions // size), device)
            group = _Group(rows, 1, None, None, mask, None,
                           block_mask(table, starts, 1, positions_of_blocks(tables, self.blocks + 1, device),
                                      self.block_tokens, self._pool_slots))
        elif 2 * rows <= lanes + 1:
            # Few rows over many lanes: copying the rows' own lanes out reads less than attending over
            # every lane (at 1 row of 16 lanes, a 17th of the keys and values; an 8-layer step's
            # pass at 1 row went from 11.7 to 7.7 ms, compiled, on a 2-core CPU).
            group = _Group(rows, 1, placed, None, mask, None)
        else:
            group = _Group(rows, 1, slice(0, lanes + 1), placed, mask, over_lanes(mask, placed, lanes + 1))
        return _Plan(torch.tensor(slots + [self.blocks * size] * pads, device=device), starts[:, None], placed,
                     (group,),
                     packed=False,
                     ends=torch.arange(rows, device=device), fills=(), lanes=lanes + 1, width=width)

    def _fill(self, lane: int, table: tuple[int, ...], first: int, end: int, device: torch.device) -> _Fill:
        positions = torch.arange(first, end, device=device)
        blocks = torch.tensor(table, device=device)[positions // self.block_tokens]
        return _Fill(lane, first, blocks * self.block_tokens + positions % self.block_tokens)

    def _group(self, tables: tuple[tuple[int, ...], ...], starts: tuple[int, ...], lanes: tuple[int, ...],
               seq: int, device: torch.device, block_indices: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, _Group]:
        """Slots and positions of rows of `seq` new tokens each, and how they attend."""
        size = self.block_tokens
        table = self._table(tables, max(len(table) for table in tables), device)
        named = table.clamp(min=0)
        first = torch.tensor(starts, device=device)
        positions = first[:, None] + torch.arange(seq, device=device)[None, :]
        slots = (named.gather(1, positions // size) * size + positions % size).flatten()
        if max(starts) == 0:  # every row new: its keys are this pass's own, under a causal mask
            mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]
            return slots, positions, _Group(len(tables), seq, None, None, mask, None)
        keys = torch.arange(max(starts) + seq, device=device)
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
        if block_indices is not None:
            past_slots = named.gather(1, (keys // size)[None].expand(len(tables), -1)
                                      .clamp(max=table.shape[1] - 1)) * size + keys % size
            return slots, positions, _Group(len(tables), seq, None, None, mask, None,
                                            block_mask(table, first, seq, block_indices, self.block_tokens,
                                                       self._pool_slots), past_slots)
        low, high = min(lanes), max(lanes) + 1
        if lanes == tuple(range(low, high)):
            return slots, positions, _Group(len(tables), seq, slice(low, high), None, mask, None)
        # Rows on lanes with gaps (others prefill or are free): the lanes between attend too, each
        # its first key only, and their output is dropped: cheaper than copying the rows' lanes out.
        placed = torch.tensor(lanes, device=device) - low
        return slots, positions, _Group(len(tables), seq, slice(low, high), placed, mask,
                                        over_lanes(mask, placed, high - low))

    @staticmethod
    def _table(tables: tuple[tuple[int, ...], ...], width: int, device: torch.device) -> torch.Tensor:
        """Block tables as one (rows, width) tensor, each padded with -1 (a block no row has)."""
        return torch.tensor([list(t) + [-1] * (width - len(t)) for t in tables], device=device)

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
        if q.device.type != "cpu" or torch.compiler.is_compiling():
            return self._attend(layer, q, k, v, scale)
        started = time.perf_counter()
        try:
            return self._attend(layer, q, k, v, scale)
        finally:
            self.attention_s += time.perf_counter() - started

    def _attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None) -> torch.Tensor:
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
        if group.blocks is not None:
            keys, values = (pool[layer].permute(1, 0, 2)[None] for pool in (self.keys, self.values))
            return attend_blocks(q, keys, values, group.blocks, self.block_tokens, scale)
        mask, keys, values = group.mask, k, v
        if group.lanes is not None:
            keys, values = self._lanes(layer, group)
            if group.placed is not None:  # each row's queries at its lane
                mask = group.lane_mask
                q = q.new_zeros((keys.shape[0], *q.shape[1:])).index_copy_(0, group.placed, q)
        batch, heads, seq, head_dim = q.shape
        kv_heads = k.shape[1]
        if seq == 1:  # decode steps: each key head's query group is its query length, under the row's mask
            grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
            out = out.reshape(batch, heads, 1, head_dim)
        else:
            if heads != kv_heads:
                keys, values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        return out if group.placed is None else out[group.placed]

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's keys and values (B, heads, T, head_dim) for `layer`; return the keys
        and values to attend over, under `attention_mask` (for a model whose attention is its own;
        not in a packed pass): views of the lanes, or, for rows on lanes with gaps between them,
        copies of the rows' lanes."""
        self._not_packed()
        self._store(layer, k, v)
        group = self.plan.groups[0]
        if group.past_slots is not None:  # paged: the rows' pasts read out of their blocks
            return tuple(pool[layer][group.past_slots].transpose(1, 2) for pool in (self.keys, self.values))
        if group.lanes is None:
            return k, v
        keys, values = self._lanes(layer, group)
        if group.placed is None:
            return keys, values
        return keys[group.placed], values[group.placed]

    def _lanes(self, layer: str, group: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (lanes, heads, W, head_dim) of the group's lanes up to its last new position."""
        width = group.mask.shape[-1]
        return self.lane_keys[layer][group.lanes, :, :width], self.lane_values[layer][group.lanes, :, :width]

    def _store(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """This pass's keys and values into their blocks and their rows' lanes (a lane first given
        the positions before it that it does not hold)."""
        batch, heads, seq, head_dim = k.shape
        if layer not in self.keys:  # the layer's (local) head count is known at its first call
            shape = (self._pool_slots, heads, head_dim)
            self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
            if self.fixed is not None:
                # Imported here: torch._dynamo costs a second to import, paid only by compiled decoding
                # (every training worker imports the models).
                from torch._dynamo import mark_static_address

                mark_static_address(self.keys[layer])
                mark_static_address(self.values[layer])
        plan = self.plan
        for pools, new in (((self.keys, self.lane_keys), k), ((self.values, self.lane_values), v)):
            tokens = new.transpose(1, 2).reshape(batch * seq, heads, head_dim)
            pools[0][layer][plan.slots] = tokens
            if self.paged:
                continue
            pool, lanes = pools[0][layer], self._grown(pools[1], layer, heads, head_dim, new)
            for fill in plan.fills:
                lanes[fill.lane, :, fill.first:fill.first + fill.slots.numel()] = pool[fill.slots].transpose(0, 1)
            lanes[plan.token_lanes, :, plan.positions.flatten()] = tokens

    @property
    def _pool_slots(self) -> int:
        """Positions each layer's pool holds: the blocks', and a fixed cache's scratch block's."""
        return (self.blocks + (self.fixed is not None)) * self.block_tokens

    def _check_fixed(self, count: int, width: int) -> None:
        if count > self.fixed[0] + 1 or width > self.fixed[1]:
            raise RuntimeError(f"a step needs {count} lanes of {width} positions; the cache was fixed at "
                               f"{self.fixed[0]} of {self.fixed[1]}")

    def _grown(self, lanes: dict[str, torch.Tensor], layer: str, heads: int, head_dim: int,
               like: torch.Tensor) -> torch.Tensor:
        """`layer`'s lanes, made larger first where this step needs more lanes or positions (to
        the next power of two, so that a growing sequence is copied over a few times only)."""
        have = lanes.get(layer)
        count, width = self.plan.lanes, self.plan.width
        if have is not None and self.fixed is not None:
            # Allocated whole: a compiled step (one `takes_padded` let through) is not compared with
            # its width, which would specialize its graph on it, one graph per width.
            if not torch.compiler.is_compiling():
                self._check_fixed(count, width)
            return have
        if have is not None and have.shape[0] >= count and have.shape[2] >= width:
            return have
        if self.fixed is not None:
            self._check_fixed(count, width)
            from torch._dynamo import mark_static_address

            lanes[layer] = like.new_zeros((self.fixed[0] + 1, heads, self.fixed[1], head_dim))
            mark_static_address(lanes[layer])
            return lanes[layer]
        old_count, old_width = (0, 0) if have is None else (have.shape[0], have.shape[2])
        grown = like.new_zeros((max(old_count, power_of_two(count)), heads,
                                max(old_width, power_of_two(max(width, LANE_POSITIONS))), head_dim))
        if have is not None:
            grown[:old_count, :, :old_width] = have
        lanes[layer] = grown
        return grown
