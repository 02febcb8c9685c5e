"""OpenAI's responses, rendered: a request's frames turned into the bytes of
its JSON body or server-sent events (:class:`Reply`), and the bodies of
``GET /v1/models``. Pure.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from gateway.openai_errors import OpenAIError
from gateway.openai_types import (
    ChatChoice,
    ChatChunkChoice,
    Delta,
    MessageOut,
    Model,
    ModelList,
    ParsedRequest,
    Response,
    TextChoice,
    UsageOut,
)
from shared.protocol import Done

SSE_DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


class Reply:
    """The response to one OpenAI request, built from the frames of its request.

    Streaming: :meth:`head` once, then :meth:`token` per token and
    :meth:`done` or :meth:`stream_error` at the end, each the bytes of
    server-sent events. Otherwise: :meth:`token` gathers the text and
    :meth:`done` gives the one JSON body. ``num_prompt_tokens`` is the
    prompt's length as tokenized, for the usage so far in each chunk
    (``continuous_usage_stats``).
    """

    def __init__(
        self,
        parsed: ParsedRequest,
        served_model: str,
        request_id: str,
        *,
        num_prompt_tokens: int,
        created: int | None = None,
    ) -> None:
        self._parsed = parsed
        self._model = served_model
        prefix = "chatcmpl-" if parsed.kind == "chat" else "cmpl-"
        self._id = prefix + request_id
        self._num_prompt_tokens = num_prompt_tokens
        self._created = int(time.time()) if created is None else created
        self._texts: list[str] = []

    @property
    def is_chat(self) -> bool:
        return self._parsed.kind == "chat"

    def head(self) -> bytes:
        """The first event of a stream (chat: the assistant's role)."""
        if not self._parsed.stream:
            raise ValueError("head() is for streaming replies")
        if not self.is_chat:
            return b""
        return self._event(Delta(role="assistant", content=""), None, self._usage_so_far(0))

    def token(self, text: str, num_completion_tokens: int) -> bytes:
        """One token's text, the request's ``num_completion_tokens``-th: an event
        when streaming (none for empty text), else kept."""
        if not self._parsed.stream:
            self._texts.append(text)
            return b""
        if not text:
            return b""
        usage = self._usage_so_far(num_completion_tokens)
        return self._event(Delta(content=text), None, usage, text)

    def done(self, done: Done) -> bytes:
        """The end: a stream's last events and ``[DONE]``, or the whole JSON body."""
        finish_reason = finish_reason_of(done)
        usage = UsageOut(
            prompt_tokens=done.usage.prompt_tokens,
            completion_tokens=done.usage.completion_tokens,
            total_tokens=done.usage.prompt_tokens + done.usage.completion_tokens,
            prompt_tokens_details=done.usage.prompt_tokens_details,
        )
        if not self._parsed.stream:
            text = "".join(self._texts)
            choices: list[Any]
            if self.is_chat:
                choices = [ChatChoice(0, MessageOut("assistant", text), None, finish_reason)]
                kind = "chat.completion"
            else:
                choices = [TextChoice(0, text, None, finish_reason)]
                kind = "text_completion"
            return _encoder.encode(
                Response(self._id, kind, self._created, self._model, choices, usage)
            )
        usage_so_far = self._usage_so_far(done.usage.completion_tokens)
        events = self._event(Delta(), finish_reason, usage_so_far)
        if self._parsed.include_usage:
            events += _sse(self._response([], usage))
        return events + SSE_DONE

    def stream_error(self, error: OpenAIError) -> bytes:
        """An error after the stream began: an ``error`` event, then ``[DONE]``."""
        return b"data: " + error.body() + b"\n\n" + SSE_DONE

    def _usage_so_far(self, num_completion_tokens: int) -> UsageOut | msgspec.UnsetType | None:
        """A chunk's ``usage``: the counts so far with continuous_usage_stats;
        else ``null`` with include_usage (only the last chunk has them), as
        OpenAI sends it; else none."""
        if self._parsed.continuous_usage:
            return UsageOut(
                prompt_tokens=self._num_prompt_tokens,
                completion_tokens=num_completion_tokens,
                total_tokens=self._num_prompt_tokens + num_completion_tokens,
            )
        return None if self._parsed.include_usage else msgspec.UNSET

    def _event(
        self,
        delta: Delta,
        finish_reason: str | None,
        usage: UsageOut | msgspec.UnsetType | None,
        text: str = "",
    ) -> bytes:
        choice: Any
        if self.is_chat:
            choice = ChatChunkChoice(0, delta, None, finish_reason)
        else:
            choice = TextChoice(0, text, None, finish_reason)
        return _sse(self._response([choice], usage))

    def _response(self, choices: list[Any], usage: UsageOut | msgspec.UnsetType | None) -> Response:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        return Response(self._id, kind, self._created, self._model, choices, usage)


def finish_reason_of(done: Done) -> str:
    """OpenAI's finish_reason; a request the gateway cancelled itself reads as
    ``abort``, as vLLM reports it."""
    return "abort" if done.finish_reason == "cancelled" else done.finish_reason


def _sse(response: Response) -> bytes:
    return b"data: " + _encoder.encode(response) + b"\n\n"


def models_body(served_model: str, context_tokens: int, created: int) -> bytes:
    """``GET /v1/models``: the one model this service serves."""
    return _encoder.encode(ModelList("list", [_model(served_model, context_tokens, created)]))


def model_body(served_model: str, context_tokens: int, created: int) -> bytes:
    """``GET /v1/models/{model}``: the model, as ``GET /v1/models`` lists it."""
    return _encoder.encode(_model(served_model, context_tokens, created))


def _model(served_model: str, context_tokens: int, created: int) -> Model:
    return Model(served_model, "model", created, "orcapod", context_tokens)
