"""Run a function on N local processes joined in a gloo process group, without Ray.

For tests and benchmarks of the parallel math, where Ray adds nothing but start-up time.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# How long a rank waits for the others at the rendezvous: torch's default.
RENDEZVOUS_TIMEOUT = timedelta(minutes=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from a server process that has imported these once: a spawned process imports
# torch and the package anew, about 3 s of CPU each here, which dominated short launches.
PRELOAD = ["torch", "torch.distributed", "shardyard.train.trainer"]


def _entry(rank: int, world_size: int, port: int, out_dir: str, env: dict[str, str], cwd: str,
           backend: str, fn: Callable, args: tuple) -> None:
    # The fork server's environment and directory are those of the first launch: use the caller's.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # What torchrun (and Ray Train) set for each worker; DeepSpeed reads them.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    # One share of the cores per rank, as torchrun and Ray Train give: oversubscribed intra-op
    # threads would make every rank slower than the same work done by fewer processes.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank, as Ray Train gives each worker
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """Call `fn(rank, world_size, *args)` on every rank; return each rank's result, by rank.
    `backend="nccl"`: rank r on GPU r (tests marked `gpu`).
    `fn` must be importable (defined at module level): ranks unpickle it by name."""
    mp.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    # The caller hosts the ranks' store on a port the kernel gives it while binding, and holds it
    # until they end: a port found free and handed on can be taken by another process before a
    # rank binds it (EADDRINUSE), which a busy test machine did.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=RENDEZVOUS_TIMEOUT)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world_size, store.port, out, dict(os.environ), os.getcwd(), backend, fn, args),
                           nprocs=world_size, join=True, start_method="forkserver")
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world_size)]
