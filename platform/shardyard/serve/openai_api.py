"""OpenAI's completions, chat and models schemas, as the official client, LangChain and LLM load
tools speak them: request bodies (validated: a field the server cannot honour is refused with its
name, never ignored), response and stream-chunk bodies, stop strings, and the error shape.

Fields clients send at their neutral values (penalties 0, no logit bias, no logprobs, best_of 1,
user) are accepted; any other value is refused with 422 rather than silently not applied.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4  # as OpenAI's API


class _Sampling(BaseModel):
    """What completions and chat requests share."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, validate_default=True)  # validated into a list
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # the range torch's generator takes
    stream: bool = False
    n: int = Field(1, ge=1, le=1, description="one choice per prompt")
    user: str | None = Field(None, max_length=256)
    # Accepted only at the values that mean "off", which is what this server does.
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    logprobs: Literal[False, 0] | None = None
    stream_options: dict[str, bool] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"up to {MAX_STOP_STRINGS} non-empty stop strings")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(min_length=1)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list[str]) -> list[str]:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one character")
        return prompts


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)

    @model_validator(mode="after")
    def _ends_for_the_assistant(self) -> ChatRequest:
        if self.messages[-1].role == "assistant":
            raise ValueError("the last message is the assistant's: nothing to answer")
        return self


# Used when the tokenizer brings no chat template (and for the byte-level models, which have
# none): one line per message, then the assistant's turn.
PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"


def render_chat(messages: list[Message], tokenizer: Any) -> str:
    """The prompt for a conversation: the tokenizer's own chat template when it has one, else
    PLAIN_CHAT_TEMPLATE per message followed by "assistant:"."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    return "".join(PLAIN_CHAT_TEMPLATE.format(role=m.role, content=m.content) for m in messages) + "assistant:"


class StopStrings:
    """Text as it is generated, cut before the first stop string. Streamed text holds back the
    tail that could still become a stop string, so no piece of one is ever sent."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.text, self.sent, self.stopped = stops, "", 0, False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, piece: str) -> str:
        """Add `piece`; return what may be sent now (all of it up to a stop string, once found)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, max(0, self.sent - self.hold)) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.text = True, self.text[:min(hits)]
            return self._take(len(self.text))
        return self._take(len(self.text) - self.hold)

    def finish(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self.sent)
        piece, self.sent = self.text[self.sent:upto], upto
        return piece


def completion_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def choice(index: int, text: str, finish_reason: str | None, chat: bool, delta: bool = False,
           first: bool = False) -> dict[str, Any]:
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if not delta:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    content = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": index, "delta": content, "finish_reason": finish_reason}


def body(id_: str, model: str, choices: list[dict[str, Any]], chat: bool, chunk: bool = False,
         usage: dict[str, int] | None = None) -> dict[str, Any]:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    out: dict[str, Any] = {"id": id_, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None or not chunk:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout", 413: "invalid_request_error", 422: "invalid_request_error",
               500: "server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, which its clients turn into typed exceptions carrying the message."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
