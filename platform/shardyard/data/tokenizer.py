"""Tokenizers for prepared data: UTF-8 bytes, a Hugging Face tokenizer from a local directory, or
a byte-level BPE trained on the data with the `tokenizers` library.

Every tokenizer but bytes is kept as a Hugging Face tokenizer directory (what
`AutoTokenizer.from_pretrained` reads), so training, serving and an exported model all load the
same one; Ray Data's workers get it as its `tokenizer.json` text, with no shared filesystem.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

END_OF_TEXT = "<|endoftext|>"  # the special token a trained BPE puts between documents


@dataclass(frozen=True)
class TokenizerInfo:
    """What the shards' index records: enough to rebuild the encoder on any worker."""

    kind: str  # "bytes" or "hf"
    vocab_size: int
    eos_id: int | None  # put after every document, when the tokenizer has one
    json: str | None = None  # the `tokenizers` serialization (kind "hf")


BYTES = TokenizerInfo("bytes", 256, None)


def from_directory(path: str | Path) -> tuple[TokenizerInfo, object]:
    """A local Hugging Face tokenizer directory (a model's own): (its info, the transformers
    tokenizer, to save beside the shards)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer.path {str(path)!r}: {type(tokenizer).__name__} has no `tokenizers` backend "
                         f"(a tokenizer.json); convert it with transformers first")
    return TokenizerInfo("hf", len(tokenizer), tokenizer.eos_token_id, backend.to_str()), tokenizer


def train_bpe(texts: Iterable[str], vocab_size: int) -> tuple[TokenizerInfo, object]:
    """A byte-level BPE trained on `texts` (every byte is in its alphabet: no text is unknown),
    with END_OF_TEXT as its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT)
    return TokenizerInfo("hf", bpe.get_vocab_size(), bpe.token_to_id(END_OF_TEXT), bpe.to_str()), tokenizer


@lru_cache(maxsize=4)
def _backend(json: str):  # one per worker process, not one per batch
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json)


def encode_documents(info: TokenizerInfo, texts: Sequence[str]) -> list[np.ndarray]:
    """Each document's ids (uint32), followed by the end-of-text id where the tokenizer has one."""
    if info.kind == "bytes":
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]
    eos = [] if info.eos_id is None else [info.eos_id]
    encoded = _backend(info.json).encode_batch(list(texts), add_special_tokens=False)
    return [np.array(e.ids + eos, dtype=np.uint32) for e in encoded]


def run_tokenizer(checkpoint_dir: str | Path) -> object | None:
    """The tokenizer the checkpoint's run was trained with (a transformers tokenizer), where its
    data was prepared with one: the launcher keeps a copy in the run directory. None for
    byte-level data."""
    from shardyard.data.shards import TOKENIZER_DIR

    tokenizer_dir = Path(checkpoint_dir).parent / TOKENIZER_DIR
    if not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))
