"""`torch.distributed.checkpoint` (DCP) reads and writes as checkpoints need them.

- Writes checksum every file as DCP writes it (`ChecksummedWriter`): the stream DCP writes into
  passes each byte through CRC-32C on its way, so the commit record lists each file's size and
  checksum without a second pass over the data. Local files are fsynced by DCP (`sync_files`).
- Reads run no code from the checkpoint (safe_load.py) and, for tensors DCP cannot describe,
  go through a stand-in: DCP cannot write a strided shard (tensor parallelism's packed gate and
  up projections: its chunks of a tensor are not contiguous), so checkpoints hold such tensors as
  plain shards of the same dimension, and what DCP reads into those is copied back
  (layout/dcp_placements.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # torch exports no public name for it

from shardyard.checkpoint.record import BadCheckpoint, Checksum, FileEntry
from shardyard.checkpoint.safe_load import SafeLoadPlanner, safe_reader
from shardyard.layout.dcp_placements import through_stand_ins


def read_dcp(state: dict[str, Any], checkpoint_id: str | Path, *, expected: dict[str, FileEntry] | None = None,
             **kwargs: Any) -> None:
    """Fill `state` in place from the DCP checkpoint at `checkpoint_id`, running no code from it;
    a packed tensor is read through a plain-shard stand-in and copied back into its own layout.
    `expected`: the commit record's files, each file read checked against them (BadCheckpoint, on
    every rank, if one does not match). `kwargs` go to `dcp.load` (`no_dist`, `process_group`)."""
    reader = safe_reader(checkpoint_id, expected)
    reader.read_metadata()  # refused here, as BadCheckpoint, before DCP wraps the error
    with through_stand_ins(state) as read:
        try:
            dcp.load(read, storage_reader=reader, planner=SafeLoadPlanner(), **kwargs)
        except CheckpointException as err:  # DCP gives every rank each rank's error
            bad = [f"rank {r}: {exc}" for r, (exc, _) in sorted(err.failures.items()) if isinstance(exc, BadCheckpoint)]
            if bad:
                raise BadCheckpoint("; ".join(bad)) from None
            raise


class _ChecksummedStream:
    """A writable stream that checksums what passes through it to the real one."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.checksum = Checksum()

    def write(self, data: Any) -> int:
        self.checksum.update(data)
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._stream, name)


class _ChecksummedFS:
    """DCP's filesystem object, with every file it writes checksummed into `files` (by name in
    the checkpoint directory; a temporary name follows its file when DCP renames it)."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self.files: dict[str, FileEntry] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._fs.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            counted = _ChecksummedStream(stream)
            yield counted
        with self._lock:
            self.files[_name(path)] = counted.checksum.entry()

    def rename(self, path: Any, new_path: Any) -> None:
        self._fs.rename(path, new_path)
        with self._lock:
            if _name(path) in self.files:
                self.files[_name(new_path)] = self.files.pop(_name(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def _name(path: Any) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def checksummed_writer(checkpoint_id: str) -> tuple[FileSystemWriter, dict[str, FileEntry]]:
    """DCP's writer for a local path (files fsynced) or an object store URI, and the dict it
    fills with each file it writes: {name: {"size", "crc32c"}}."""
    writer = FsspecWriter(checkpoint_id) if "://" in checkpoint_id else FileSystemWriter(checkpoint_id, sync_files=True)
    fs = _ChecksummedFS(writer.fs)
    writer.fs = fs
    return writer, fs.files
