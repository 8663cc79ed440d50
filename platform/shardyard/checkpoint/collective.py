"""What the checkpoint formats and the manager share: collectives that also run in one process,
node-local scratch space, and storage errors raised as such."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardyard.checkpoint.record import FileEntry


def barrier() -> None:
    if not dist.is_initialized():
        return
    # NCCL's barrier runs on a GPU: name this rank's own (the one Ray Train or the trainer made
    # current) instead of letting c10d guess it and warn about the guess at every checkpoint.
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@contextmanager
def single_process_io() -> Iterator[None]:
    """DCP warns when it reads or writes from one process without a process group; here that
    is meant (serving, export, the parameter-server driver)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single process")
        yield


@contextmanager
def node_scratch() -> Iterator[tuple[Path, bool]]:
    """Collective: a temporary directory shared by the ranks of this node (the node's first rank
    owns it and removes it afterwards), and whether this rank is that first rank."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if dist.is_initialized() else 0
    with tempfile.TemporaryDirectory(prefix="shardyard-scratch-") as mine:
        scratch = Path(mine)
        if dist.is_initialized():
            everyones: list[str] = [""] * dist.get_world_size()
            dist.all_gather_object(everyones, mine)
            # Ray Train and torchrun number ranks node by node: the node's first is rank - local_rank.
            scratch = Path(everyones[dist.get_rank() - local_rank])
        yield scratch, local_rank == 0


class CheckpointWriteError(RuntimeError):
    """A checkpoint that storage refused (a full disk, an object store's error): the run stops
    with the storage's own error; its last committed checkpoint is untouched."""


@contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Raise a failed write as the storage's error, named. DCP reports one as a
    CheckpointException, a BaseException that `except Exception` handlers let through, holding
    each rank's error; ZeRO's files are written locally and copied up, where storage raises OSError."""
    try:
        yield
    except CheckpointException as err:
        reasons = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(err.failures.items()))
        raise CheckpointWriteError(f"checkpoint {url} could not be written ({reasons})") from None
    except OSError as err:
        raise CheckpointWriteError(f"checkpoint {url} could not be written "
                                   f"(rank {rank()}: {type(err).__name__}: {err})") from None


@dataclass
class Written:
    """A format's write of one rank's part of a checkpoint: `future` while it goes on in the
    background (None once done), and `files()`, once it is done, the files this rank wrote
    with their sizes and checksums (by path in the checkpoint directory)."""

    future: Future | None
    files: Callable[[], dict[str, FileEntry]]
