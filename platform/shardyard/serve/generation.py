"""Text generation over any forward function, for a batch of ragged prompts at once.

Prompts of different lengths are left-padded into one batch and the padding masked out (see
GPT.forward's `pad`), so each row's tokens equal those of its prompt generated alone. Each row
samples with its own temperature and its own seeded generator, in the same order as alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

Forward = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]  # (tokens, pad) -> logits


@dataclass
class Completion:
    """One request's decoding state. `tokens` grows as they are generated; decoding that stops
    (a lost shard) resumes from prompt + tokens with the same random generator, so a retried
    request still gets the tokens it would have got."""
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    top_p: float = 1.0
    stop_token: int | None = None  # the tokenizer's end of sequence, if it has one
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None

    @property
    def stopped(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] == self.stop_token

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_tokens or self.stopped


def encode(text: str) -> list[int]:
    """The byte-level vocabulary the corpus is trained on: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


class TextCodec:
    """Text <-> token ids for a served model: UTF-8 bytes (the byte-level models), or the
    tokenizer its model directory brings (a transformers tokenizer)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return encode(text) if self.tokenizer is None else self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: Sequence[int]) -> str:
        return decode(tokens) if self.tokenizer is None else self.tokenizer.decode(list(tokens))


class TextStream:
    """The text of a growing token sequence, piece by piece: a character split over several
    tokens (the bytes of one UTF-8 character, a tokenizer's byte pieces) comes with its last one."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec, self.tokens, self.sent = codec, [], 0

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.codec.decode(self.tokens)
        if text.endswith("\ufffd"):  # an unfinished character: wait for the rest of it
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece

    def finish(self) -> str:
        """What is still held back when decoding stops (a character that never completed)."""
        text = self.codec.decode(self.tokens)
        piece, self.sent = text[self.sent:], len(text)
        return piece


def left_pad(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) token ids, right-aligned, and (B,) the padding count of each row."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
    return tokens, torch.tensor([width - len(p) for p in prompts])


def decode_steps(forward: Forward, requests: Sequence[Completion], block_size: int,
                 abandoned: Callable[[int], bool] = lambda row: False) -> Iterator[list[int]]:
    """Decode every unfinished request together, one token per forward pass; after each pass,
    yield the rows (indices into `requests`) that got a token, appended to their `tokens`.

    A row leaves the batch once it has its tokens, or once `abandoned(row)` says nobody waits for
    it any more (timed out, disconnected): the others go on without paying for it.
    """
    rows = [i for i, r in enumerate(requests) if not r.done and not abandoned(i)]
    if not rows:
        return
    tokens, pad = left_pad([requests[i].prompt + requests[i].tokens for i in rows])
    while rows:
        overflow = max(0, tokens.shape[1] - block_size)  # crop to the context window
        logits = forward(tokens[:, overflow:], (pad - overflow).clamp(min=0))[:, -1, :].float()
        chosen = [pick(logits[k], requests[row].temperature, requests[row].generator, requests[row].top_p)
                  for k, row in enumerate(rows)]
        for row, token in zip(rows, chosen):
            requests[row].tokens.append(token)
        yield rows
        tokens = torch.cat([tokens, torch.tensor(chosen).unsqueeze(1)], dim=1)
        keep = [k for k, row in enumerate(rows) if not requests[row].done and not abandoned(row)]
        if len(keep) < len(rows):
            tokens, pad, rows = tokens[keep], pad[keep], [rows[k] for k in keep]
            width = int(pad.min()) if len(keep) else 0  # drop columns that are padding in every row
            tokens, pad = tokens[:, width:], pad - width


def generate(forward: Forward, requests: Sequence[Completion], block_size: int) -> list[list[int]]:
    """Every request's new tokens: `max_tokens` each, greedy at temperature 0, else sampled."""
    for _ in decode_steps(forward, requests, block_size):
        pass
    return [r.tokens for r in requests]


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None, top_p: float = 1.0) -> int:
    """The next token: the most likely at temperature 0; else sampled at `temperature` from the
    smallest set of tokens whose probabilities reach `top_p` (nucleus sampling)."""
    if torch.isnan(logits).any():
        raise RuntimeError("the model's logits hold NaN: no token can be chosen")
    if temperature <= 0:
        return int(logits.argmax())
    scaled = logits / temperature
    # A temperature so small that the scaled logits overflow is, in the limit, greedy decoding
    # (the softmax of an infinity is not a distribution: sampling from it would raise).
    if torch.isposinf(scaled).any():
        return int(logits.argmax())
    probs = F.softmax(scaled, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        outside = ordered.cumsum(-1) - ordered >= top_p  # the mass before it already reaches top_p
        probs = torch.zeros_like(probs).scatter(-1, order, ordered.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))
