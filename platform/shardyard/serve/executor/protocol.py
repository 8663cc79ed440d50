"""What the engine asks of whatever runs the model (vLLM's executor): one forward pass that picks
each row's token where the logits are, a weight swap in three steps (prepare beside, swap, drop or
swap back), and health. LocalModel (the replica's own process, executor/local_model.py) and
ShardedModel (a group of shard actors, executor/shards.py) implement it."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from shardyard.checkpoint.published import Published
from shardyard.serve.executor.model_pass import Draws, Extra
from shardyard.serve.sampling import Outcome


class ModelExecutor(Protocol):
    block_size: int  # the model's context
    dtype: torch.dtype  # its weights' and KV cache's
    cache_attends: bool  # the model attends over a KVCache's blocks (packed passes run)
    executor: Executor | None  # where a pass is called from (None: any thread of asyncio's)
    checkpoint_dir: str  # what serves now
    rebuilds: int  # shard groups replaced so far

    def forward(self, tokens: torch.Tensor, extra: Extra = None,
                draws: Draws = None) -> torch.Tensor | Sequence[Outcome]: ...

    def prepare(self, source: str | Published) -> bool: ...

    def swap(self) -> None: ...

    def swap_back(self) -> None: ...

    def drop_staged(self) -> None: ...

    def exclusive(self) -> AbstractContextManager: ...

    def healthy(self, timeout_s: float = 5.0) -> bool: ...

    def heal(self, rebuild_if_slow: bool = False, timeout_s: float = 5.0) -> bool: ...

    def rebuild(self, failed: int | None = None) -> bool: ...

    def close(self) -> None: ...
