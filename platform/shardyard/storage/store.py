"""A run directory's files, on a local path or an object store (through fsspec): what the
checkpoint manager, the logs and the run lease read and write.

Local writes are durable: a file is written under a temporary name, fsynced, renamed into place,
and its directory fsynced, so a power cut leaves the old file or the new one, never a torn one.
(An object store's PUT is whole or absent, and durable once it returns.) `create_exclusive` is
the one atomic primitive the run lease needs: a file made only if no file has its name.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import secrets
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import fsspec

DIR_PREFIX = "checkpoint_step_"
# Only names the run writes itself (8 digits, more from step 100,000,000 on, never a leading zero
# beyond 8): a user's `checkpoint_step_00000050.bak` copy is never pruned.
CHECKPOINT_NAME = re.compile(rf"^{DIR_PREFIX}(\d{{8}}|[1-9]\d{{8,}})$")


def local_path_of(uri: str) -> str:
    """`file:///x` is the local path `/x`: fsspec would make it a store of its own whose writes
    are never fsynced and whose exclusive create is check-then-write (two launches could both
    take the run's lease). Any other URI, or a path, is returned as it is."""
    if uri.startswith("file://"):
        return uri[len("file://"):] or "/"
    return uri


def fsync_path(path: str | Path) -> None:
    """Flush a local file or directory to the disk (a directory: the names it holds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TREE_REMOVAL_PASSES = 5


def remove_tree(path: str) -> None:
    """Remove a local directory that another process may still be writing in: a launch taken over
    (its lease lost, which it learns at its next fence check) finishing a file of a save the new
    holder deletes. A file it renames away meanwhile is gone already; one it adds is removed on
    the next pass. (shutil.rmtree alone raised FileNotFoundError there, and the restore failed.)"""

    def tolerate_the_writer(_function: object, _name: str, raised: BaseException | tuple) -> None:
        error = raised[1] if isinstance(raised, tuple) else raised  # onerror's exc_info, or onexc's error
        if isinstance(error, FileNotFoundError) or getattr(error, "errno", None) == errno.ENOTEMPTY:
            return  # renamed or removed by the writer; or a directory it added to: the next pass
        raise error

    handler = {"onexc" if sys.version_info >= (3, 12) else "onerror": tolerate_the_writer}
    for _ in range(TREE_REMOVAL_PASSES):
        shutil.rmtree(path, **handler)
        if not os.path.lexists(path):
            return
    shutil.rmtree(path)  # a writer still adding files: said as shutil says it


class RunStorage:
    """A run directory on a local path or an object store, through fsspec."""

    def __init__(self, run_dir: str | Path) -> None:
        self.uri = local_path_of(str(run_dir))
        # No listings cache: object stores' filesystems keep the listings they read, and a
        # process that watches a run (a serving app following it, a driver, the launcher) would
        # never see a checkpoint that another process committed since.
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, use_listings_cache=False)
        self.remote = "://" in self.uri

    def url(self, *parts: str) -> str:
        """What DCP and users are given: a local path, or the URI for object storage."""
        return "/".join([self.uri.rstrip("/"), *parts])

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def size(self, *parts: str) -> int:
        return int(self.fs.size(self.path(*parts)))

    def _local_temporary(self, final: str, data: bytes) -> str:
        """`data` in a fsynced temporary file beside `final`."""
        directory = os.path.dirname(final)
        os.makedirs(directory, exist_ok=True)
        # Not mkstemp: its files are 0600 whatever the umask, which made a run's commit records,
        # specs and exports unreadable to another user serving or copying the run (DCP's own
        # files beside them follow the umask, as these now do).
        partial = os.path.join(directory, f".{os.path.basename(final)}.partial-{secrets.token_hex(8)}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return partial

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Written whole and durably: a reader, or a crash, never sees half of it."""
        final = self.path(*parts)
        if self.remote:
            self.fs.pipe_file(final, data)
            return
        os.replace(self._local_temporary(final, data), final)
        fsync_path(os.path.dirname(final))

    def create_exclusive(self, data: bytes, *parts: str) -> bool:
        """Write `parts` only if nothing has that name yet, atomically: True if this call made it.
        Locally a fully written temporary file is hard-linked to the name (link fails when the
        name exists); on object storage a conditional PUT (`If-None-Match: *`)."""
        final = self.path(*parts)
        if self.remote:
            try:
                self.fs.pipe_file(final, data, mode="create")
            except FileExistsError:
                return False
            except OSError as err:  # an S3 412 Precondition Failed surfaces as OSError
                if "PreconditionFailed" in str(err) or "412" in str(err):
                    return False
                raise
            return True
        partial = self._local_temporary(final, data)
        try:
            os.link(partial, final)
        except FileExistsError:
            return False
        finally:
            os.unlink(partial)
        fsync_path(os.path.dirname(final))
        return True

    def sync(self, *parts: str) -> None:
        """Make the files and the directory at `parts` durable (local storage; object stores
        are durable once a write returns)."""
        if self.remote:
            return
        top = self.path(*parts)
        for directory, _, files in os.walk(top):
            for name in files:
                fsync_path(os.path.join(directory, name))
            fsync_path(directory)
        fsync_path(os.path.dirname(top))

    def place(self, source: str, name: str) -> bool:
        """Rename directory `source` to `name` only if nothing holds that name: True if it did.
        Locally one rename(2), which refuses a directory that has files (and replaces an empty
        one). Local storage only: an object store has no such rename, so there `name` is claimed
        by its commit record alone (record.py) and every caller takes that branch instead."""
        if self.remote:
            raise ValueError(f"{self.url()}: place() is for local storage; an object store is committed by its record")
        try:
            os.rename(self.path(source), self.path(name))
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                return False
            raise
        fsync_path(self.root)
        return True

    def set_aside(self, name: str, why: str) -> str:
        """Move `name` out of the run's names in one step (`<name>.<why>-<random>`) and return
        where it went: a reader or a crash never sees it half gone, and what moved can be read
        again where it is now (it may not be what the caller judged before the move)."""
        aside = f"{name}.{why}-{secrets.token_hex(4)}"
        if self.remote:
            self.fs.mv(self.path(name), self.path(aside), recursive=True)
        else:
            os.rename(self.path(name), self.path(aside))
            fsync_path(self.root)
        return aside

    def delete(self, *parts: str) -> None:
        if not self.exists(*parts):
            return
        if self.remote:
            self.fs.rm(self.path(*parts), recursive=True)
        elif os.path.isdir(self.path(*parts)):
            remove_tree(self.path(*parts))
        else:
            with suppress(FileNotFoundError):
                os.remove(self.path(*parts))

    def list(self, *parts: str) -> list[str]:
        """Names directly under `parts` (none if it does not exist)."""
        if not self.exists(*parts):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(*parts), detail=False))

    def checkpoint_names(self) -> list[str]:
        """The run's checkpoint directories, oldest first (by step: a name's digits grow past 8):
        only names of the form it writes."""
        steps = {n: int(m.group(1)) for n in self.list() if (m := CHECKPOINT_NAME.match(n))}
        return sorted(steps, key=steps.__getitem__)

    @contextmanager
    def private_copy(self, *parts: str) -> Iterator[Path]:
        """A copy of the directory at `parts` in a temporary directory of this user's alone (mode
        700), named as its last part: what is read from it is what was there when it was copied,
        whoever else can write the run's directory (a file checked, then swapped, is not loaded)."""
        with tempfile.TemporaryDirectory(prefix="shardyard-private-") as tmp:
            local = Path(tmp, parts[-1])
            if self.remote:
                local.mkdir()
                # The trailing slash copies the directory's contents, not the directory, into `local`.
                self.fs.get(f"{self.path(*parts)}/", str(local), recursive=True)
            else:
                shutil.copytree(self.path(*parts), local)
            yield local
