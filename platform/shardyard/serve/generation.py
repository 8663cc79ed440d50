"""Text generation over any forward function, for a batch of ragged prompts at once.

Prompts of different lengths are left-padded into one batch and the padding masked out (see
GPT.forward's `pad`), so each row's tokens equal those of its prompt generated alone. Each row
samples as its own request says (sampling.Draw), wherever the logits are: the executor that runs
the model picks the tokens, and only token ids come back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardyard.serve.sampling import GREEDY, Draw, Outcome, Pick, Sampling, choose_rows

Forward = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]  # (tokens, pad) -> logits
# (tokens, pad, each row's draw) -> each row's outcome: the model picks its tokens where it runs
SampledForward = Callable[[torch.Tensor, torch.Tensor | None, Sequence[Draw | None]], list[Outcome]]


@dataclass
class Completion:
    """One choice's decoding state. `tokens` grows as they are generated; decoding that stops
    (a lost shard) resumes from prompt + tokens, and since each token's draw depends only on the
    seed and its index, a retried request still gets the tokens it would have got."""
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = GREEDY
    seed: int | None = None
    stop_token: int | None = None  # the tokenizer's end of sequence, if it has one
    tokens: list[int] = field(default_factory=list)
    picks: list[Pick] = field(default_factory=list)  # with logprobs asked for: one per token
    # When its HTTP request reached the replica (time.perf_counter: the machine's monotonic clock,
    # the same in an engine core's process): time to first token counts from it, the wait for the
    # replica's admission included. None: when the engine takes it.
    arrived: float | None = None

    @property
    def stopped(self) -> bool:
        return (bool(self.tokens) and self.tokens[-1] == self.stop_token and not self.sampling.ignore_eos
                and len(self.tokens) > self.sampling.min_tokens)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_tokens or self.stopped

    def draw(self) -> Draw:
        """What choosing the next token needs, to send where the logits are."""
        s = self.sampling
        return Draw(s, self.seed, len(self.tokens), self.stop_token,
                    prompt=tuple(self.prompt) if s.repetition_penalty != 1.0 else (),
                    generated=tuple(self.tokens) if s.penalized or s.min_tokens else ())

    def accept(self, chosen: Pick) -> int:
        """Append the token chosen for it."""
        self.tokens.append(chosen.token)
        if self.sampling.logprobs is not None:
            self.picks.append(chosen)
        return chosen.token

    def advance(self, logits: torch.Tensor) -> int:
        """Choose the next token from its (V,) logits here and append it."""
        return self.accept(self.draw().pick(logits))


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

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (its byte for the byte-level models; its decoded text's otherwise)."""
        return bytes([token]) if self.tokenizer is None else self.tokenizer.decode([token]).encode("utf-8")


class TextStream:
    """The text of a growing token sequence, piece by piece: a character split over several
    tokens (the bytes of one UTF-8 character, a tokenizer's byte pieces) comes with its last one.

    Each token decodes a window of the newest tokens, not the whole sequence (which made a
    2,000-token answer cost half a second of decoding on the event loop): the tokens since the
    last piece sent, after those of the piece before them as context, since a tokenizer may
    decode a token differently at the start of a text (a leading space dropped). The window's
    text less its context's is the new piece (vLLM's incremental detokenizing does the same)."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec, self.tokens = codec, []
        self.context = 0  # where the window starts: the first token of the last piece sent
        self.read = 0     # the tokens whose text was sent

    def push(self, token: int) -> str:
        self.tokens.append(token)
        before, text = self._window()
        if text.endswith("\ufffd") or len(text) <= len(before):  # an unfinished character: wait
            return ""
        self.context, self.read = self.read, len(self.tokens)
        return text[len(before):]

    def finish(self) -> str:
        """What is still held back when decoding stops (a character that never completed)."""
        before, text = self._window()
        self.context = self.read = len(self.tokens)
        return text[len(before):]

    def _window(self) -> tuple[str, str]:
        """The text of the context, and of the context with the tokens not sent yet."""
        return self.codec.decode(self.tokens[self.context:self.read]), self.codec.decode(self.tokens[self.context:])


def left_pad(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) token ids, right-aligned, and (B,) the padding count of each row."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
    return tokens, torch.tensor([width - len(p) for p in prompts])


def sampled_here(forward: Forward) -> SampledForward:
    """A forward pass that returns logits, with the tokens picked in this process (a model run
    in-process, such as the one-process reference)."""
    return lambda tokens, pad, draws: choose_rows(forward(tokens, pad)[:, -1, :], draws)


def decode_steps(forward: SampledForward, requests: Sequence[Completion], block_size: int,
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
        outcomes = forward(tokens[:, overflow:], (pad - overflow).clamp(min=0), [requests[r].draw() for r in rows])
        for outcome in outcomes:
            if isinstance(outcome, RuntimeError):
                raise outcome
        chosen = [requests[row].accept(outcome) for row, outcome in zip(rows, outcomes)]
        yield rows
        tokens = torch.cat([tokens, torch.tensor(chosen).unsqueeze(1)], dim=1)
        keep = [k for k, row in enumerate(rows) if not requests[row].done and not abandoned(row)]
        if len(keep) < len(rows):
            tokens, pad, rows = tokens[keep], pad[keep], [rows[k] for k in keep]
            width = int(pad.min()) if len(keep) else 0  # drop columns that are padding in every row
            tokens, pad = tokens[:, width:], pad - width


def generate(forward: Forward, requests: Sequence[Completion], block_size: int) -> list[list[int]]:
    """Every request's new tokens: `max_tokens` each, as its sampling says (picked here)."""
    for _ in decode_steps(sampled_here(forward), requests, block_size):
        pass
    return [r.tokens for r in requests]
