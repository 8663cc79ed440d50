"""OpenAI's completions, chat and models schemas, as the official client, LangChain and LLM load
tools speak them: request bodies (validated: a field the server cannot honour is refused with its
name, never ignored), response and stream-chunk bodies, log-probabilities, stop strings, and the
error shape.

Besides OpenAI's own fields, requests take the sampling extensions vLLM's OpenAI-compatible server
accepts and load tools send (`vllm bench serve` always sends `repetition_penalty` and, on random
data, `ignore_eos`): `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, and
`stream_options.continuous_usage_stats`. `echo`, `suffix` and `best_of` > 1 are refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shardyard.serve.sampling import MAX_LOGPROBS, Sampling

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API
DEFAULT_MAX_TOKENS = 16  # as OpenAI's completions API


# Seeds within int64, as vLLM's own server bounds them (its engine refuses larger ones); a request's
# choice j draws from seed + j, wrapped within the same range (choice_seed).
SEED_LIMIT = 2**63 - 1


def choice_seed(seed: int | None, choice: int) -> int | None:
    return None if seed is None else (seed + choice) % (SEED_LIMIT + 1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False            # a last chunk with the usage
    continuous_usage_stats: bool = False   # vLLM's: the usage so far in every chunk


class _Sampling(BaseModel):
    """What completions and chat requests share."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description=f"default {DEFAULT_MAX_TOKENS}")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0: every token")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)  # token id -> bias
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop: str | list[str] | None = Field(None, validate_default=True)  # validated into a list
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, description="choices per prompt")
    user: str | None = Field(None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"up to {MAX_STOP_STRINGS} non-empty stop strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias and any(token < 0 or not -100 <= value <= 100 for token, value in bias.items()):
            raise ValueError("token ids >= 0 mapped to biases from -100 to 100")
        return bias

    @property
    def new_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def sampling(self) -> Sampling:
        """The request's sampling; `top_alternatives` (each request kind names its log-probability
        fields its own way) says how many alternatives to report per token, None for none."""
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
                        repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens,
                        ignore_eos=self.ignore_eos, logprobs=self.top_alternatives,
                        logit_bias=tuple(sorted((self.logit_bias or {}).items())))

    @field_validator("min_tokens")
    @classmethod
    def _at_least_within_at_most(cls, min_tokens: int, info: ValidationInfo) -> int:
        at_most = info.data.get("max_tokens") or DEFAULT_MAX_TOKENS
        if min_tokens > at_most:
            raise ValueError(f"min_tokens {min_tokens} is over max_tokens {at_most}")
        return min_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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

    @property
    def top_alternatives(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    """A piece of a message's content; only text (an image or audio part is refused by name)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _one_name_for_the_length(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("max_completion_tokens") is not None:
            if data.get("max_tokens") is not None:
                raise ValueError("give max_completion_tokens or max_tokens, not both")
            data = {**data, "max_tokens": data["max_completion_tokens"]}
        return data

    @model_validator(mode="after")
    def _ends_for_the_assistant(self) -> ChatRequest:
        if self.messages[-1].role == "assistant":
            raise ValueError("the last message is the assistant's: nothing to answer")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# Used when the tokenizer brings no chat template (and for the byte-level models, which have
# none): one line per message, then the assistant's turn.
PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"
# OpenAI's newer name for the system role, which most models' chat templates do not know.
TEMPLATE_ROLES = {"developer": "system"}


def render_chat(messages: list[Message], tokenizer: Any) -> str:
    """The prompt for a conversation: the tokenizer's own chat template when it has one, else
    PLAIN_CHAT_TEMPLATE per message followed by "assistant:"."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        turns = [{"role": TEMPLATE_ROLES.get(m.role, m.role), "content": m.text} for m in messages]
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return "".join(PLAIN_CHAT_TEMPLATE.format(role=m.role, content=m.text) for m in messages) + "assistant:"


class StopStrings:
    """Text as it is generated, cut before the first stop string. Streamed text holds back the
    tail that could still become a stop string, so no piece of one is ever sent."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.text, self.sent, self.stopped = stops, "", 0, False
        self.checked = 0  # text before this (less a stop string's length) was let through unchecked
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, piece: str, armed: bool = True) -> str:
        """Add `piece`; return what may be sent now (all of it up to a stop string, once found).
        Until `armed`, stop strings are not looked for (a request's `min_tokens`)."""
        self.text += piece
        if not armed:
            self.checked = len(self.text)
            return self._take(len(self.text) - self.hold)
        hits = [i for i in (self.text.find(s, max(0, self.sent - self.hold, self.checked - self.hold))
                            for s in self.stops) if i >= 0]
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
           first: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A choice in a response or a stream chunk; `logprobs` in the request kind's own shape."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if not delta:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    content = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}


def body(id_: str, model: str, fingerprint: str, choices: list[dict[str, Any]], chat: bool, chunk: bool = False,
         usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A response or a stream chunk; `fingerprint` names the weights that made it."""
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    out: dict[str, Any] = {"id": id_, "object": kind, "created": int(time.time()), "model": model,
                           "system_fingerprint": fingerprint, "choices": choices}
    if usage is not None or not chunk:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error",
               408: "timeout", 413: "invalid_request_error", 422: "invalid_request_error",
               500: "server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, which its clients turn into typed exceptions carrying the message."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
