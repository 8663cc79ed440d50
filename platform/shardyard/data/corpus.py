"""Text corpus: any text file or folder, or by default the Python stdlib's own sources, as token
ids: its UTF-8 bytes (the byte-level models), or the ids of the tokenizer a model brings.

The text is held in memory as one token array and read through the same windows as prepared
shards (data/shards.py): non-overlapping samples of `block_size + 1` tokens, each named by one
integer, so every rank can fetch any sample without coordination.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from shardyard.data.shards import TokenWindows

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}


def default_corpus_files() -> list[Path]:
    """The standard library's .py files: present on every machine that runs Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in stdlib.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and p.is_file()
    )


def corpus_files(path: str | None) -> list[Path]:
    if path is None:
        return default_corpus_files()
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if files:
            return files
        raise FileNotFoundError(f"data.path {path!r} holds no text files ({sorted(TEXT_SUFFIXES)})")
    raise FileNotFoundError(f"data.path {path!r} does not exist")


def read_corpus(path: str | None, max_bytes: int) -> bytes:
    chunks, size = [], 0
    for file in corpus_files(path):
        chunk = file.read_bytes()[: max_bytes - size]
        chunks.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break
    return b"".join(chunks)


def corpus_windows(path: str | None, block_size: int, max_bytes: int, tokenizer: Any = None) -> TokenWindows:
    """The first `max_bytes` of the text as samples, through the shard reader: its bytes, or
    `tokenizer`'s ids (a transformers tokenizer: every rank tokenizes the same text the same way)."""
    data = read_corpus(path, max_bytes)
    if tokenizer is None:
        return TokenWindows.in_memory(np.frombuffer(data, dtype=np.uint8), block_size)
    ids = tokenizer(data.decode("utf-8", errors="replace"), add_special_tokens=False, verbose=False)["input_ids"]
    return TokenWindows.in_memory(np.array(ids, dtype=np.int32), block_size)
