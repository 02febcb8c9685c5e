"""The OpenAI API's shapes: the request bodies of Chat Completions and
Completions as msgspec Structs (unknown fields refused), a request as
orcapod understands it (:class:`ParsedRequest`), and the response bodies and
stream chunks. Pure data; ``gateway/openai_api.py`` parses into them,
``gateway/openai_reply.py`` renders from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from shared.protocol import Generate, PromptTokensDetails

# OpenAI's default for the legacy completions endpoint.
DEFAULT_COMPLETION_MAX_TOKENS = 16

Kind = Literal["chat", "text"]


# --- request bodies ------------------------------------------------------------------


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One part of a message's content; only ``text`` parts can be served."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class MessageIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    # Informational in OpenAI's API; ChatML has no place for it.
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class SamplingFields(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What both endpoints take; ``null`` is the default for every field, as
    clients that send every field they know expect."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions, at the top level as vLLM takes them.
    top_k: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None


class ChatCompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True):
    messages: list[MessageIn] = []
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True):
    prompt: str | list[Any] | None = None
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


@dataclass(frozen=True)
class ParsedRequest:
    """An OpenAI request in orcapod's terms."""

    kind: Kind
    generate: Generate
    stream: bool
    # A last chunk with the usage (stream_options.include_usage).
    include_usage: bool
    # The usage so far in every chunk too (and continuous_usage_stats, as vLLM
    # takes it: without include_usage it asks for nothing).
    continuous_usage: bool


# --- response bodies -----------------------------------------------------------------


class UsageOut(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Known at the end (the prefix cache's share): absent from a chunk's usage so far.
    prompt_tokens_details: PromptTokensDetails | msgspec.UnsetType = msgspec.UNSET


class Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class MessageOut(msgspec.Struct, frozen=True):
    role: str
    content: str


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: MessageOut
    logprobs: None
    finish_reason: str


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: str | None


class TextChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class Response(msgspec.Struct, frozen=True, omit_defaults=True):
    """A whole response (``chat.completion``, ``text_completion``) or one chunk of a stream."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice] | list[ChatChunkChoice] | list[TextChoice]
    usage: UsageOut | msgspec.UnsetType | None = msgspec.UNSET


class Model(msgspec.Struct, frozen=True):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct, frozen=True):
    object: str
    data: list[Model]
