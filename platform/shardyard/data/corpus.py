"""Text corpus: any text file or folder, or by default the Python stdlib's own sources, as token
ids: its UTF-8 bytes (the byte-level models), or the ids of the tokenizer a model brings.

Samples are non-overlapping windows of `block_size + 1` tokens (inputs and next-token targets),
so a sample is named by one integer and every rank can fetch any sample without coordination.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch

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


class TextCorpus:
    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one sample of {block_size + 1}")
        self.tokens = tokens
        self.block_size = block_size
        self.window = torch.arange(block_size + 1)

    @classmethod
    def from_path(cls, path: str | None, block_size: int, max_bytes: int, tokenizer: Any = None) -> TextCorpus:
        """The first `max_bytes` of the text, as bytes, or as `tokenizer`'s ids (a transformers
        tokenizer: every rank tokenizes the same text the same way)."""
        data = read_corpus(path, max_bytes)
        if tokenizer is None:
            return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8), block_size)
        ids = tokenizer(data.decode("utf-8", errors="replace"), add_special_tokens=False, verbose=False)["input_ids"]
        return cls(torch.tensor(ids, dtype=torch.int32), block_size)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tokens[ids[:, None] * self.block_size + self.window].long()
        return rows[:, :-1], rows[:, 1:]
