"""From one choice's tokens to what its client receives: the text (a character split over several
tokens held back until complete, cut before a stop string), why it ended, and the
log-probabilities of the tokens behind each piece, in the completions or the chat shape.

Streamed or not, a choice's text and log-probabilities come from here, so the two agree.
"""

from __future__ import annotations

from typing import Any

from shardyard.serve.generation import Completion, TextCodec, TextStream
from shardyard.serve.http.openai_api import StopStrings


class ChoiceText:
    def __init__(self, request: Completion, codec: TextCodec, stops: list[str], chat: bool) -> None:
        self.request, self.codec, self.chat = request, codec, chat
        self.stream, self.cut = TextStream(codec), StopStrings(stops)
        self.reported = 0  # tokens whose log-probabilities went out
        self.offset = 0    # characters before the next reported token (completions' text_offset)

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.cut.stopped

    def push(self, token: int) -> str:
        """Add the next token; return the text that may be sent now. Stop strings count only from
        `min_tokens` on, as the end of sequence does."""
        armed = len(self.request.tokens) >= self.request.sampling.min_tokens
        return self.cut.push(self.stream.push(token), armed)

    def finish(self) -> str:
        """What is still held back once decoding ended."""
        return self.cut.finish() if self.cut.stopped else self.cut.push(self.stream.finish()) + self.cut.finish()

    def text(self) -> str:
        return self.cut.text

    @property
    def finish_reason(self) -> str:
        return "stop" if self.cut.stopped or self.request.stopped else "length"

    def logprobs(self) -> dict[str, Any] | None:
        """The log-probabilities of the tokens not reported yet, or None when none were asked for."""
        if self.request.sampling.logprobs is None:
            return None
        picks = self.request.picks[self.reported:]
        self.reported += len(picks)
        if self.chat:
            return {"content": [{**self._token(p.token, p.logprob),
                                 "top_logprobs": [self._token(t, lp) for t, lp in p.top]} for p in picks]}
        pieces = [self._piece(p.token) for p in picks]
        offsets = []
        for piece in pieces:
            offsets.append(self.offset)
            self.offset += len(piece)
        return {"tokens": pieces, "token_logprobs": [p.logprob for p in picks],
                "top_logprobs": [{self._piece(t): lp for t, lp in (*p.top, (p.token, p.logprob))} for p in picks],
                "text_offset": offsets}

    def _piece(self, token: int) -> str:
        return self.codec.token_bytes(token).decode("utf-8", errors="replace")

    def _token(self, token: int, logprob: float | None) -> dict[str, Any]:
        raw = self.codec.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
