"""The OpenAI API's request bodies (validated with pydantic) and response shapes, for ``/v1/completions`` and
``/v1/chat/completions``.

Supported: one prompt (text or token ids) per request, ``n`` 1, ``max_tokens`` (chat: also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop`` (strings), ``stream`` with
``stream_options.include_usage``, the chosen tokens' log-probabilities (completions: ``logprobs: 0``; chat:
``logprobs: true`` with ``top_logprobs`` 0), and the extensions ``top_k`` and ``stop_token_ids``. A field
outside these, or a value the engine cannot honour (``n`` > 1, penalties, ``logit_bias``, ``echo``,
alternatives in ``logprobs``) is refused with a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "parse_request", "validation_message"]

DEFAULT_COMPLETION_MAX_TOKENS = 16          # the OpenAI API's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256               # a chat's default when the model declares no context length
MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None                        # extension (as vLLM's): None, 0 or -1 for all tokens
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = Field(None, validate_default=True)     # a list after validation
    stop_token_ids: list[int] = Field(default_factory=list)     # extension, beside the tokenizer's EOS
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _all_tokens(cls, value):
        if value is not None and value < -1:
            raise ValueError("must be a positive integer, or -1 / 0 / null for all tokens")
        return None if value in (0, -1) else value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def wants_logprobs(self) -> bool:
        raise NotImplementedError


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Literal[0] | None = None
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(value)}")
            value = value[0]
        if len(value) == 0:
            raise ValueError("the prompt is empty")
        return value

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")         # name, tool_calls, ...: passed to the chat template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value):
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Literal[0] | None = None
    add_generation_prompt: bool = True              # extension (as vLLM's)

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def message_dicts(self) -> list[dict]:
        return [message.model_dump(exclude_none=True) for message in self.messages]


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """A pydantic error as one message naming the parameter, and that parameter."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return f"unknown parameter {param!r}, not supported by this server", param
    if first["type"] == "missing":
        return f"missing parameter {param!r}", param
    return f"invalid parameter {param!r}: {first['msg']}", param


def parse_request(model: type[BaseModel], document) -> BaseModel:
    """Validate a decoded JSON body; APIError 400 naming the parameter."""
    if not isinstance(document, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(document).__name__}")
    try:
        return model.model_validate(document)
    except ValidationError as error:
        message, param = validation_message(error)
        raise APIError(400, message, param=param) from None


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int) -> dict:
    """The legacy completions' logprobs object (``text_offset``: each token's start in the completion text,
    from ``offset``)."""
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    return {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
                        for token, logprob in zip(tokens, logprobs)]}
