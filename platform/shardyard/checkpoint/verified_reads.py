"""Checksums checked as a checkpoint is read, not in a pass of their own.

A restore once read every file twice: rank 0 read them all to check sizes and checksums against
the commit record, then every rank read them again to load (an 8.4 GB checkpoint, twice, before a
relaunch's first step). Here DCP's file system is wrapped so each file a rank opens is read once,
start to end, its CRC-32C compared with the record's, and DCP's reads then served from that one
copy: a local file's memory map (the page cache, shared by the ranks of a node, no second disk
read), a remote file's downloaded bytes. A file that does not match raises BadCheckpoint before
any of it is used, and the restore falls back to an older checkpoint (checkpoint/manager.py)."""

from __future__ import annotations

import io
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import Any

import crc32c

from shardyard.checkpoint.record import COMMIT_FILE, BadCheckpoint, FileEntry, check_file


def check_entry(data: Any, expected: FileEntry | None, where: str) -> None:
    """`data` (bytes, or any buffer) is the file the record lists at `where`; BadCheckpoint if not."""
    if expected is None:
        raise BadCheckpoint(f"{where} is not listed in its checkpoint's commit record")
    check_file(where, expected, memoryview(data).nbytes, crc32c.crc32c(data))


class MemoryReader(io.RawIOBase):
    """A seekable binary stream over a buffer, copying only what is read (DCP's file views and
    torch.load read through `readinto`)."""

    def __init__(self, buffer: Any) -> None:
        super().__init__()
        self._view = memoryview(buffer).cast("B")
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._view.nbytes}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, b: Any) -> int:
        chunk = self._view[self._position:self._position + memoryview(b).nbytes]
        memoryview(b).cast("B")[:chunk.nbytes] = chunk
        self._position += chunk.nbytes
        return chunk.nbytes

    def close(self) -> None:
        self._view.release()
        super().close()


class VerifiedFiles:
    """DCP's file system (local or fsspec) whose streams opened for reading are files checked
    against `expected` (by path relative to the checkpoint directory `root`)."""

    def __init__(self, fs: Any, root: Any, expected: dict[str, FileEntry]) -> None:
        self._fs, self._root, self._expected = fs, str(root).rstrip("/"), expected

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped file system's
        return getattr(self._fs, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        relative = str(PurePosixPath(str(path).removeprefix(self._root).lstrip("/")))
        if mode != "rb" or relative == COMMIT_FILE:  # the record itself lists the others
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        with self._fs.create_stream(path, mode) as stream, _whole(stream) as data:
            check_entry(data, self._expected.get(relative), str(path))
            with MemoryReader(data) as reader:
                yield reader


@contextmanager
def _whole(stream: Any) -> Iterator[Any]:
    """The stream's whole content: a memory map of a local file, else its bytes."""
    try:
        descriptor = stream.fileno()
        empty = os.fstat(descriptor).st_size == 0
    except (AttributeError, OSError, io.UnsupportedOperation):
        yield stream.read()
        return
    if empty:  # mmap refuses empty files
        yield b""
        return
    mapped = mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
    try:
        yield mapped
    finally:
        mapped.close()
