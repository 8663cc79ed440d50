"""The keys and values of every sequence being decoded, so that a new token attends to the past
without recomputing it: the cost of a decode step no longer grows with the context (beyond
attention reading the cached keys).

One preallocated slab per attention layer, (rows, heads, max_len, head_dim): row r holds one
sequence. Rows [0, active) are in use and always contiguous, so a decode step over every
running sequence reads the slab's first `active` rows in place, with no gather. Releasing a row
moves the last active row into it; the engine that schedules the sequences applies the same
moves to its own list (`compact`), and so does every shard of a sharded model, each for its own
layers (pipeline) or its own heads (tensor): they all see the same steps in the same order.

A long prompt may be prefilled in chunks (chunked prefill): its first chunk opens a row like any
prefill, each later one `extend`s it, attending over the chunks before. While a prompt is partial
its row is kept last (`partial` on a step: releases move other rows, never it), and decode steps
cover the rows before it.

Memory is fixed at start: rows x max_len tokens, the bound the serving engine admits against.
"""

from __future__ import annotations

from collections.abc import MutableSequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class CacheStep:
    """What one forward pass does with the cache. `prefill`: a new sequence's prompt (1, T), or
    its first chunk, goes into row `active` (the next free row). `extend`: the next chunk (1, T)
    of the prompt in the last row. `decode`: one token (rows, 1) for each of rows [0, rows).
    `release`: rows freed before the pass, applied as `compact` applies them; `partial`: the last
    row holds a prompt not yet whole (it stays last). `reset`: every row freed, nothing computed
    (a caller starting over after an error)."""
    kind: Literal["prefill", "extend", "decode", "reset"]
    rows: int = 1
    release: tuple[int, ...] = ()
    partial: bool = False


def compact(rows: MutableSequence[T], release: tuple[int, ...], partial: bool = False) -> None:
    """Free `release` from `rows`, moving the last row into each freed one (highest first, so a
    moved row is never one being freed). With `partial` the last row (a prompt being prefilled,
    never released) stays last: the others are compacted before it."""
    kept = rows.pop() if partial else None
    for row in sorted(release, reverse=True):
        last = rows.pop()
        if row < len(rows):
            rows[row] = last
    if partial:
        rows.append(kept)


@dataclass
class KVCache:
    rows: int     # sequences held at once
    max_len: int  # tokens per sequence: the model's context window
    keys: dict[str, torch.Tensor] = field(default_factory=dict)    # layer name -> slab
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)               # tokens held, per active row
    step: CacheStep | None = None

    @property
    def active(self) -> int:
        return len(self.lengths)

    def begin(self, step: CacheStep) -> None:
        """Start a forward pass: free the released rows, then check the step fits."""
        if step.kind == "reset":
            self.lengths = []
            return
        if step.release:
            # As `compact` moves list items: each freed row takes the last row still active (the
            # partial prompt's row aside, which then moves to the new end).
            partial_row = self.active - 1 if step.partial else None
            last = self.active - 1 - step.partial
            for row in sorted(step.release, reverse=True):
                if row < last:
                    self._move(last, row)
                last -= 1
            if partial_row is not None and partial_row != last + 1:
                self._move(partial_row, last + 1)
            compact(self.lengths, step.release, step.partial)
        if step.kind == "prefill" and self.active >= self.rows:
            raise RuntimeError(f"the KV cache's {self.rows} rows are all in use")
        if step.kind == "extend" and not step.partial:
            raise RuntimeError("an extend step needs a partial prompt in the last row")
        if step.kind == "decode" and step.rows != self.active - step.partial:
            raise RuntimeError(f"a decode step over {step.rows} rows, but {self.active} are in use"
                               f"{' (one a partial prompt)' if step.partial else ''}")
        self.step = step

    def _move(self, source: int, target: int) -> None:
        for slab in (*self.keys.values(), *self.values.values()):
            slab[target] = slab[source]

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """Position ids of this pass's tokens: (1, seq) from 0 for a prefill, (rows, 1) after
        each row's past for a decode step."""
        if self.step.kind == "prefill":
            return torch.arange(seq, device=device)[None]
        if self.step.kind == "extend":
            return torch.arange(self.lengths[-1], self.lengths[-1] + seq, device=device)[None]
        return torch.tensor(self.lengths[:self.step.rows], device=device)[:, None]

    def attention_mask(self, seq: int, device: torch.device) -> torch.Tensor:
        """This pass's boolean attention mask over the keys `update` returns: causal (1, 1, T, T)
        for a prefill; for a decode step (rows, 1, 1, W), W the longest row's past plus one, each
        row seeing its own past and its new token only (shorter rows' tail is stale)."""
        if self.step.kind == "prefill":
            return torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]
        if self.step.kind == "extend":  # the chunk's query i sees the past and the chunk up to i
            past = self.lengths[-1]
            return torch.ones(seq, past + seq, dtype=torch.bool, device=device).tril(past)[None, None]
        at = torch.tensor(self.lengths[:self.step.rows], device=device)  # each row's new position
        return (torch.arange(int(at.max()) + 1, device=device)[None, :] <= at[:, None])[:, None, None, :]

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's keys and values (B, heads, T, head_dim) for `layer`; return the keys
        and values to attend over, under `attention_mask`."""
        if layer not in self.keys:  # the layer's (local) head count is known at its first call
            shape = (self.rows, k.shape[1], self.max_len, k.shape[3])
            self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        keys, values = self.keys[layer], self.values[layer]
        if self.step.kind == "prefill":
            row, length = self.active, k.shape[2]
            if length > self.max_len:
                raise RuntimeError(f"a prompt of {length} tokens exceeds the context of {self.max_len}")
            keys[row, :, :length], values[row, :, :length] = k[0], v[0]
            return k, v
        if self.step.kind == "extend":
            row, past, length = self.active - 1, self.lengths[-1], k.shape[2]
            if past + length > self.max_len:
                raise RuntimeError(f"a prompt of {past + length} tokens exceeds the context of {self.max_len}")
            keys[row, :, past:past + length], values[row, :, past:past + length] = k[0], v[0]
            return keys[row:row + 1, :, :past + length], values[row:row + 1, :, :past + length]
        rows = self.step.rows
        at = torch.tensor(self.lengths[:rows], device=k.device)  # each row's next position
        if int(at.max()) >= self.max_len:
            raise RuntimeError(f"a sequence reached the context of {self.max_len} tokens")
        index = torch.arange(rows, device=k.device)
        keys[index, :, at], values[index, :, at] = k[:, :, 0], v[:, :, 0]
        width = int(at.max()) + 1
        return keys[:rows, :, :width], values[:rows, :, :width]

    def end(self, prompt_len: int) -> None:
        """Finish a forward pass: the rows now hold one more token (decode), a prompt or its first
        chunk (prefill), or the next chunk (extend)."""
        if self.step.kind == "prefill":
            self.lengths.append(prompt_len)
        elif self.step.kind == "extend":
            self.lengths[-1] += prompt_len
        else:
            rows = self.step.rows
            self.lengths = [n + 1 for n in self.lengths[:rows]] + self.lengths[rows:]
        self.step = None
