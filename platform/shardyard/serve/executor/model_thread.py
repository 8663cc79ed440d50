"""Where a served model's CPU work runs: on one thread, so that PyTorch's OpenMP threads are one team.

Every thread that runs a parallel PyTorch operation gets its own OpenMP team (GNU OpenMP keeps a
pool of threads per calling thread), and once the teams hold more threads than the machine has
cores, every team stops spinning between operations and sleeps instead, so each of a forward
pass's hundreds of operations waits for its threads to wake. Measured on this project's 2-core
machine: a 16-row decode pass of benchmarks/serve_vs_vllm.py's Llama took 25 ms on the thread
that had loaded the model and 40 ms on another thread of the same process, which is where the
engine ran it (asyncio's executor, any of its threads). So a model decoded in the replica loads
and runs every pass on its own thread, and the work beside it that loads weights (a checkpoint
staged while passes go on) runs with one intra-op thread, adding no team.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """PyTorch's operations on this thread run on it alone meanwhile (no OpenMP team of its own);
    a thread that already runs with more keeps them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class ModelThread:
    """One thread that runs what it is given, in turn, and waits for each. `executor` hands work
    to it without a thread in between (asyncio's `run_in_executor`); work that calls `run` from
    the thread itself runs at once."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="shardyard-model")
        # The thread takes the process's intra-op thread count now and keeps it: PyTorch sets a
        # thread's count at its first parallel operation, from whatever the count is then.
        self.executor.submit(torch.get_num_threads).result()
        self._thread = self.executor.submit(threading.current_thread).result()

    def run(self, work: Callable[..., T], *args: object) -> T:
        if threading.current_thread() is self._thread:
            return work(*args)
        return self.executor.submit(work, *args).result()

    def close(self) -> None:
        self.executor.shutdown(wait=True)


class StepThreads:
    """The OpenMP threads of each pass, set on the model's thread before it runs: a one-row decode
    step (one stream's next token) on `one_row` threads, every other pass on the team the thread
    started with. A pass waits at each of its operations for its slowest thread; at one row there
    is little for a second thread to share, and the core it would take is the one the replica
    streams the last token on meanwhile (docs/benchmarks.md, "The engine core's threads")."""

    def __init__(self, team: int, one_row: int) -> None:
        self.team, self.one_row, self.now = team, one_row, team

    def enter(self, tokens: torch.Tensor) -> None:
        wanted = self.one_row if tokens.numel() == 1 else self.team
        if wanted != self.now:
            torch.set_num_threads(wanted)
            self.now = wanted
