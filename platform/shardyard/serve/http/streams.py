"""Several choices' tokens as they are decoded, read as one stream: what a request with several
prompts or n > 1 streams to its client.

Tokens that arrived while the reader was busy (sending the previous chunk) travel together: a
choice gets at most one message per read however many tokens its decoder produced meanwhile, so
a slow reader costs fewer, larger chunks rather than a backlog of one-token ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

END = None  # what the reader gets, in place of tokens, once a choice's decoding ended


class Interleaved:
    def __init__(self, streams: list[AsyncIterator[int]], deadline: float) -> None:
        """`deadline`: a time.perf_counter() value; reading past it raises asyncio.TimeoutError."""
        self.deadline = deadline
        self.queue: asyncio.Queue[tuple[int, int | BaseException | None]] = asyncio.Queue()
        self.tasks = [asyncio.get_running_loop().create_task(self._pump(i, s)) for i, s in enumerate(streams)]
        self.open = set(range(len(streams)))
        # When each choice's decoding ended (perf_counter), as the engine finished it: not when the
        # client read its last chunk, which a client reading slowly would make as late as it likes.
        self.ended_at: dict[int, float] = {}

    async def _pump(self, index: int, stream: AsyncIterator[int]) -> None:
        try:
            async for token in stream:
                self.queue.put_nowait((index, token))
            self.ended_at[index] = time.perf_counter()
            self.queue.put_nowait((index, END))
        except Exception as err:  # noqa: BLE001 - handed to the reader, which raises it
            self.queue.put_nowait((index, err))

    def drop(self, index: int) -> None:
        """Stop reading choice `index` (a stop string ended it)."""
        self.ended_at.setdefault(index, time.perf_counter())
        self.open.discard(index)
        self.tasks[index].cancel()

    def decoded_at(self) -> float:
        """When the last choice's decoding ended (every choice has ended)."""
        return max(self.ended_at.values())

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def __aiter__(self) -> AsyncIterator[tuple[int, list[int] | None]]:
        """(index, the tokens it got since its last message), and (index, END) once it ended;
        raises the first error a choice's decoding raised."""
        while self.open:
            items = [await asyncio.wait_for(self.queue.get(), max(0.0, self.deadline - time.perf_counter()))]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            got: dict[int, list[int]] = {}
            ended: list[int] = []
            for index, item in items:
                if isinstance(item, BaseException):
                    raise item
                if index not in self.open:  # dropped while its tokens were queued
                    continue
                if item is END:
                    ended.append(index)
                else:
                    got.setdefault(index, []).append(item)
            for index, tokens in got.items():
                yield index, tokens
            for index in ended:
                if index in self.open:  # the reader may have dropped it on the tokens just yielded
                    self.open.discard(index)
                    yield index, END
