"""Which KV cache block holds what (the scheduler's side of models/kv_cache.py's paged cache).

A block is free, held by the running sequences that read it (counted: a prefix block may be read
by several), or idle: held by none but keeping its contents, findable by the hash of its tokens
and every token before them, until its room is needed (least recently used first). That hash is
what automatic prefix caching looks up: a new prompt whose first blocks of tokens hash as blocks
already in the cache reads those blocks and prefills only the rest.

Only full blocks are hashed (a full block's positions are never written again), and a block is
hashed once the pass that wrote it has run, so a sequence that finds it reads what it says.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], block_tokens: int, known: list[bytes]) -> list[bytes]:
    """The chained hashes of `tokens`' full blocks: block i's is a hash of block i-1's and block
    i's tokens, so equal hashes mean equal tokens from the start. SHA-256, not Python's `hash`:
    a prompt crafted to collide with another user's prefix would read that user's keys and
    values (vLLM changed to SHA-256 for this). `known`: the first hashes, already worked out."""
    hashes = list(known)
    for i in range(len(hashes), len(tokens) // block_tokens):
        digest = hashlib.sha256(hashes[-1] if hashes else b"")
        digest.update(array("q", tokens[i * block_tokens:(i + 1) * block_tokens]).tobytes())
        hashes.append(digest.digest())
    return hashes


class BlockPool:
    def __init__(self, blocks: int, block_tokens: int, prefix_caching: bool = True) -> None:
        self.blocks, self.block_tokens, self.prefix_caching = blocks, block_tokens, prefix_caching
        self.clear()
        self.prompt_tokens = 0  # of prompts allocated, and of those found in the cache: the hit rate
        self.hit_tokens = 0

    def clear(self) -> None:
        """Every block free, every hash forgotten (the cache's contents were lost)."""
        self.free: deque[int] = deque(range(self.blocks))
        self.readers = [0] * self.blocks
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # hashed, held by none: least recently used first

    @property
    def used(self) -> int:
        """Blocks held by running sequences."""
        return self.blocks - len(self.free) - len(self.idle)

    def allocate(self, tokens: Sequence[int], hashes: list[bytes], total: int) -> tuple[list[int], int] | None:
        """Blocks for a sequence whose known tokens are `tokens` (their block hashes `hashes`) and
        that may grow to `total` tokens: the blocks of its longest cached prefix (at most all but
        its last token, which a forward pass must compute for the next token's logits), then free
        ones. Returns the block table and the tokens found cached, or None: not enough room now."""
        found: list[int] = []
        if self.prefix_caching:
            for digest in hashes[:(len(tokens) - 1) // self.block_tokens]:
                block = self.by_hash.get(digest)
                if block is None:
                    break
                found.append(block)
        fresh = -(-total // self.block_tokens) - len(found)
        if fresh > len(self.free) + len(self.idle) - sum(1 for b in found if b in self.idle):
            return None
        for block in found:
            self.idle.pop(block, None)
            self.readers[block] += 1
        table = found + [self._take() for _ in range(fresh)]
        self.prompt_tokens += len(tokens)
        self.hit_tokens += len(found) * self.block_tokens
        return table, len(found) * self.block_tokens

    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:  # the least recently used idle block gives up its contents
            block, _ = self.idle.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
        self.readers[block] = 1
        return block

    def register(self, table: list[int], hashes: list[bytes]) -> None:
        """The blocks of `table` that `hashes` covers are full and written: findable from now on
        (a block whose tokens another block already holds stays private)."""
        if not self.prefix_caching:
            return
        for block, digest in zip(table, hashes):
            if digest not in self.by_hash and block not in self.hash_of:
                self.by_hash[digest], self.hash_of[block] = block, digest

    def release(self, table: list[int]) -> None:
        """A sequence is done with its blocks: those no one else reads are idle if hashed (their
        contents stay findable), else free. Last block first: a sequence's tail is the least likely
        to be asked for again, so it is the first given up."""
        for block in reversed(table):
            self.readers[block] -= 1
            if self.readers[block] == 0:
                if block in self.hash_of:
                    self.idle[block] = None
                else:
                    self.free.append(block)

    @property
    def hit_rate(self) -> float:
        """The share of allocated prompt tokens that were found in the cache."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
