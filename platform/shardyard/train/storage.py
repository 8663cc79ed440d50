"""A run directory's files, on a local path or an object store (through fsspec): what the
checkpoint manager, the logs and the run lease read and write."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec

COMMIT_FILE = "COMMITTED"  # written last into a checkpoint: it is whole
DIR_PREFIX = "checkpoint_step_"


class RunStorage:
    """A run directory on a local path or an object store, through fsspec."""

    def __init__(self, run_dir: str | Path) -> None:
        self.uri = str(run_dir)
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

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Written whole under a temporary name, then renamed: a reader never sees half of it."""
        final = self.path(*parts)
        self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
        partial = f"{final}.partial-{os.getpid()}"
        self.fs.pipe_file(partial, data)
        self.fs.mv(partial, final)

    def delete(self, *parts: str) -> None:
        if self.exists(*parts):
            self.fs.rm(self.path(*parts), recursive=True)

    def checkpoint_names(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))
        return sorted(n for n in names if n.startswith(DIR_PREFIX))

    def committed(self, name: str) -> dict[str, Any] | None:
        """The commit record of checkpoint `name`, or None while it is not committed."""
        if not self.exists(name, COMMIT_FILE):
            return None
        return json.loads(self.read_bytes(name, COMMIT_FILE))

    def newest_committed(self) -> str | None:
        for name in reversed(self.checkpoint_names()):  # newest first: stop at the first found
            if self.exists(name, COMMIT_FILE):
                return name
        return None

    @contextmanager
    def local_copy(self, *parts: str) -> Iterator[Path]:
        """A local directory with the files at `parts` (the directory itself when local)."""
        if not self.remote:
            yield Path(self.path(*parts))
            return
        with tempfile.TemporaryDirectory(prefix="shardyard-download-") as tmp:
            # The trailing slash copies the directory's contents, not the directory, into `tmp`.
            self.fs.get(f"{self.path(*parts)}/", tmp, recursive=True)
            yield Path(tmp)
