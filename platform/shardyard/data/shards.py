"""Token shards: the format `shardyard prepare` writes and training reads, and the reader.

A prepared directory holds, for each split (`train`, and `validation` when asked for):
- fixed-size binary token shards, `train-00000.bin`, ... (little-endian uint16 when the vocabulary
  fits, else uint32), each followed by `train-00000.docs.npy`, the offsets where its documents start;
- `index.json`: every shard's name, token and document count, the dtype, the tokenizer (a copy
  of it lives in `tokenizer/`), and the fingerprint of the source and settings that made them.

Training reads a split as one token stream, the shards end to end (documents are joined by the
tokenizer's end-of-text token where it has one), cut into non-overlapping windows of
`block_size + 1` tokens: sample i starts at token i * block_size. A sample is named by one integer,
so the global order and every rank's share follow from the token count alone (data/sampler.py),
and a resumed run at any world size carries on at the exact next sample. A shard is memory-mapped
(and, in object storage, downloaded into a bounded local cache) the first time a sample touches
it: a rank's memory grows with the shards it reads, not with the dataset.
"""

from __future__ import annotations

import atexit
import bisect
import hashlib
import json
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

INDEX_FILE = "index.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "shardyard-tokens/1"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.bin"


def docs_name(shard: str) -> str:
    return shard.removesuffix(".bin") + ".docs.npy"


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def write_index(directory: Path, dtype: np.dtype, vocab_size: int, splits: dict[str, dict[str, Any]],
                **about: Any) -> None:
    """The index of a local directory of shards (`splits`: SplitWriter.close() of each split);
    `about`: the tokenizer, the source and its fingerprint."""
    index = {"format": FORMAT, "dtype": np.dtype(dtype).str, "vocab_size": vocab_size, **about, "splits": splits}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=1))


class ShardIndexError(ValueError):
    """A prepared directory whose index is missing, damaged or does not match its shards."""


def read_index(path: str) -> dict[str, Any]:
    import fsspec

    url = f"{path.rstrip('/')}/{INDEX_FILE}"
    try:
        with fsspec.open(url, "r") as f:
            index = json.load(f)
    except FileNotFoundError:
        raise ShardIndexError(f"{url} does not exist: is {path!r} a directory `shardyard prepare` wrote?") from None
    except json.JSONDecodeError as err:
        raise ShardIndexError(f"{url} is not JSON ({err}): prepare the data again") from None
    if index.get("format") != FORMAT:
        raise ShardIndexError(f"{url}: format {index.get('format')!r}, expected {FORMAT!r}: prepare the data again")
    return index


class ShardCache:
    """Shards of a directory in object storage, downloaded on first use into this process's own
    local folder, which keeps at most `max_bytes` (least recently used out first). A shard already
    mapped stays readable when its file goes: the mapping holds the pages. The folder is removed at
    exit, and folders of processes that died are removed by the next one to start."""

    def __init__(self, root: str, cache_dir: str | None, max_bytes: int) -> None:
        import fsspec

        self.root, self.max_bytes = root.rstrip("/"), max_bytes
        self.fs, _, _ = fsspec.get_fs_token_paths(self.root)
        dataset = Path(cache_dir or Path(tempfile.gettempdir()) / "shardyard-shards") / sha1(self.root)
        dataset.mkdir(parents=True, exist_ok=True)
        for other in dataset.iterdir():
            if other.name.isdigit() and not _alive(int(other.name)):
                shutil.rmtree(other, ignore_errors=True)
        self.dir = dataset / str(os.getpid())
        self.dir.mkdir(exist_ok=True)
        atexit.register(shutil.rmtree, self.dir, True)
        self._held: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recent first

    def local(self, name: str) -> Path:
        target = self.dir / name
        if name not in self._held:
            self.fs.get(f"{self.root}/{name}", str(target))
            self._held[name] = target.stat().st_size
        self._held.move_to_end(name)
        while sum(self._held.values()) > self.max_bytes and len(self._held) > 1:
            old, _ = self._held.popitem(last=False)
            (self.dir / old).unlink(missing_ok=True)
        return target


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TokenWindows:
    """Samples of `block_size + 1` tokens over token arrays laid end to end. `open_part(i)` gives
    the i-th array (a memory map, or an array in memory); it is called once, when a sample first
    reaches that part."""

    def __init__(self, lengths: Sequence[int], open_part: Callable[[int], np.ndarray], block_size: int) -> None:
        self.block_size = block_size
        self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.total = int(self.starts[-1])
        if self.total < block_size + 1:
            raise ValueError(f"the data holds {self.total} tokens, fewer than one sample of {block_size + 1}")
        self._open_part, self._parts = open_part, {}

    @classmethod
    def in_memory(cls, tokens: np.ndarray, block_size: int) -> TokenWindows:
        return cls([len(tokens)], lambda _: tokens, block_size)

    def __len__(self) -> int:
        return (self.total - 1) // self.block_size

    def _part(self, i: int) -> np.ndarray:
        if i not in self._parts:
            self._parts[i] = self._open_part(i)
        return self._parts[i]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, across part boundaries."""
        out, pos = [], start
        part = bisect.bisect_right(self.starts, start) - 1
        while pos < stop:
            offset = pos - int(self.starts[part])
            take = min(stop, int(self.starts[part + 1])) - pos
            out.append(self._part(part)[offset: offset + take])
            pos, part = pos + take, part + 1
        return np.concatenate(out) if len(out) > 1 else out[0]

    def batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        span = self.block_size + 1
        rows = np.stack([self.tokens(i * self.block_size, i * self.block_size + span) for i in ids.tolist()])
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


def open_split(path: str, split: str, block_size: int, cache_dir: str | None = None,
               cache_bytes: int = 2 << 30) -> TokenWindows:
    """A prepared directory's split as samples. Checks every shard's size against the index
    before the first sample is read (a local directory; in object storage, as a shard arrives)."""
    index = read_index(path)
    if split not in index["splits"]:
        raise ShardIndexError(f"{path}: no {split!r} split (it has {sorted(index['splits'])})")
    shards = index["splits"][split]["shards"]
    dtype = np.dtype(index["dtype"])
    cache = ShardCache(path, cache_dir, cache_bytes) if is_remote(path) else None

    def local_file(name: str) -> Path:
        return cache.local(name) if cache else Path(path.removeprefix("file://")) / name

    def check(file: Path, shard: dict) -> None:
        expected = shard["tokens"] * dtype.itemsize
        size = file.stat().st_size if file.is_file() else None
        if size != expected:
            found = "is missing" if size is None else f"has {size} bytes"
            raise ShardIndexError(f"{file} {found}; the index says {shard['tokens']} {dtype.name} tokens "
                              f"({expected} bytes): prepare the data again")

    if cache is None:
        for shard in shards:
            check(local_file(shard["name"]), shard)

    def open_part(i: int) -> np.ndarray:
        file = local_file(shards[i]["name"])
        check(file, shards[i])
        return np.memmap(file, dtype=dtype, mode="r")

    return TokenWindows([s["tokens"] for s in shards], open_part, block_size)


def validation_source(path: str, validation_path: str | None) -> tuple[str, str]:
    """(directory, split) to validate on: `validation_path`'s validation split if it has one,
    else its train split; without it, `path`'s validation split."""
    if validation_path is None:
        return path, "validation"
    return validation_path, "validation" if "validation" in read_index(validation_path)["splits"] else "train"


def tokenizer_files(path: str) -> dict[str, bytes]:
    """The files of the tokenizer saved beside the shards (`tokenizer/`); none for bytes."""
    import fsspec

    index = read_index(path)
    directory = index.get("tokenizer", {}).get("dir")
    if directory is None:
        return {}
    if directory != TOKENIZER_DIR:  # prepare writes it there; an index may not send the read elsewhere
        raise ShardIndexError(f"{path.rstrip('/')}/{INDEX_FILE} names the tokenizer's folder {directory!r}; "
                              f"prepared data keeps it in {TOKENIZER_DIR!r}: prepare the data again")
    fs, _, (root,) = fsspec.get_fs_token_paths(f"{path.rstrip('/')}/{directory}")
    return {Path(f).name: fs.cat_file(f) for f in fs.ls(root, detail=False)}
