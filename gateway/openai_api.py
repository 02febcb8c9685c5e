"""OpenAI's Chat Completions and Completions, translated to and from orcapod's
own protocol. Pure: bytes of a request body in, a ``Generate`` (or an
:class:`OpenAIError`) out; the frames the core sends for it in, the bytes of a
response (JSON, or server-sent events) out.

Everything a ``generate`` is checked for (ranges, caps, the context) stays in
``gateway/validation.py``: this module only says what OpenAI's fields mean in
orcapod's terms, and refuses clearly what orcapod cannot honour (``n`` > 1,
``logprobs``, tools, penalties) instead of ignoring it. Unknown fields are
refused too, so a typo never silently changes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, TypeVar

import msgspec

from shared.protocol import ChatMessage, Done, Error, ErrorCode, Generate, PromptTokensDetails

# The id every HTTP request's generate has on its own (one-request) socket.
HTTP_CLIENT_ID = "http"
# OpenAI's default for the legacy completions endpoint.
DEFAULT_COMPLETION_MAX_TOKENS = 16
SSE_DONE = b"data: [DONE]\n\n"

Kind = Literal["chat", "text"]


class OpenAIError(Exception):
    """A request answered with OpenAI's error object and an HTTP status."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> bytes:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return _encoder.encode(
            _ErrorBody(_ErrorDetail(self.message, self.type, self.param, self.code))
        )

    @property
    def metric_code(self) -> str:
        """The ``code`` it is counted under in ``orcapod_request_errors_total``:
        OpenAI's code when it has one; a 400 without one is ``invalid_request``,
        as the core's refusal of a bad field is; else the status
        (``forbidden``, ``not_found``, ``method_not_allowed``)."""
        if self.code is not None:
            return self.code
        if self.status == HTTPStatus.BAD_REQUEST:
            return "invalid_request"
        return HTTPStatus(self.status).phrase.lower().replace(" ", "_")


def invalid(message: str, param: str | None = None) -> OpenAIError:
    """A 400 for a request that can never succeed as sent."""
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param)


def error_of_code(code: ErrorCode, message: str) -> OpenAIError:
    """The HTTP face of one of orcapod's protocol error codes."""
    if code == "invalid_request":
        return OpenAIError(HTTPStatus.BAD_REQUEST, message)
    if code == "prompt_too_long":
        return OpenAIError(HTTPStatus.BAD_REQUEST, message, code="context_length_exceeded")
    if code == "unauthorized":
        return unauthorized(message)
    if code == "queue_full":
        return OpenAIError(
            HTTPStatus.TOO_MANY_REQUESTS,
            message,
            type="rate_limit_error",
            code="rate_limit_exceeded",
        )
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, type="server_error")


def unauthorized(message: str) -> OpenAIError:
    """A 401: no key, or not a valid one."""
    return OpenAIError(
        HTTPStatus.UNAUTHORIZED, message, type="authentication_error", code="invalid_api_key"
    )


def model_not_found(requested: str, served_model: str, param: str | None) -> OpenAIError:
    """A 404 for a model this server does not serve (``param``: the body's
    ``model``; None for the one in ``GET /v1/models/{model}``'s path)."""
    return OpenAIError(
        HTTPStatus.NOT_FOUND,
        f"the model {requested!r} does not exist; this server serves {served_model!r}",
        param=param,
        code="model_not_found",
    )


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


class ToolFunction(msgspec.Struct, frozen=True):
    name: str = ""


class MessageIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    # Informational in OpenAI's API; ChatML has no place for it.
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class _SamplingFields(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
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


class ChatCompletionRequest(_SamplingFields, frozen=True, forbid_unknown_fields=True):
    messages: list[MessageIn] = []
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, frozen=True, forbid_unknown_fields=True):
    prompt: str | list[Any] | None = None
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


_Body = TypeVar("_Body", ChatCompletionRequest, CompletionRequest)


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


def parse_chat(body: bytes, served_model: str) -> ParsedRequest:
    """A ``POST /v1/chat/completions`` body; raises :class:`OpenAIError`."""
    request = _decode(body, ChatCompletionRequest)
    if not request.messages:
        raise invalid("`messages` must be a non-empty array", "messages")
    if request.logprobs or request.top_logprobs:
        raise invalid("logprobs are not supported by this server", "logprobs")
    if request.tools:
        raise invalid("tools are not supported by this server", "tools")
    if request.tool_choice not in (None, "none", "auto"):
        raise invalid("tool_choice is not supported by this server", "tool_choice")
    if request.response_format not in (None, {"type": "text"}):
        raise invalid("only response_format {'type': 'text'} is supported", "response_format")
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    messages = [_message(index, message) for index, message in enumerate(request.messages)]
    generate = _generate(request, served_model, max_tokens, messages=messages)
    return _parsed("chat", request, generate)


def parse_completion(body: bytes, served_model: str) -> ParsedRequest:
    """A ``POST /v1/completions`` body; raises :class:`OpenAIError`."""
    request = _decode(body, CompletionRequest)
    if request.logprobs is not None:
        raise invalid("logprobs are not supported by this server", "logprobs")
    if request.echo:
        raise invalid("echo is not supported by this server", "echo")
    if request.suffix:
        raise invalid("suffix is not supported by this server", "suffix")
    if request.best_of not in (None, 1):
        raise invalid("best_of must be 1 (one completion per request)", "best_of")
    prompt, prompt_token_ids = _completion_prompt(request.prompt)
    generate = _generate(
        request, served_model, request.max_tokens, prompt=prompt, prompt_token_ids=prompt_token_ids
    )
    return _parsed("text", request, generate)


def _decode(body: bytes, kind: type[_Body]) -> _Body:
    if not body.strip():
        raise invalid("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as error:
        raise invalid(f"invalid request: {error}", _param_of(str(error))) from error
    except msgspec.DecodeError as error:
        raise invalid(f"the body is not valid JSON: {error}") from error
    except RecursionError as error:  # msgspec recurses per level of nesting
        raise invalid("the body's JSON is nested too deeply") from error


def _param_of(message: str) -> str | None:
    """``messages[0].role`` from msgspec's ``... - at `$.messages[0].role```."""
    _, found, path = message.rpartition("at `$.")
    return path.rstrip("`") if found else None


def _message(index: int, message: MessageIn) -> ChatMessage:
    where = f"messages[{index}]"
    if message.tool_calls:
        raise invalid(f"{where}.tool_calls: tool calls are not supported", f"{where}.tool_calls")
    content = message.content
    if content is None:
        raise invalid(f"{where}.content is required", f"{where}.content")
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise invalid(
                    f"{where}.content[{part_index}] is a {part.type!r} part; "
                    "only text parts are supported",
                    f"{where}.content[{part_index}]",
                )
            texts.append(part.text)
        content = "".join(texts)
    # OpenAI's newer name for the system turn.
    role = "system" if message.role == "developer" else message.role
    return ChatMessage(role=role, content=content)


def _completion_prompt(prompt: str | list[Any] | None) -> tuple[str | None, list[int] | None]:
    """One prompt: text, or token ids (OpenAI's arrays of one prompt included)."""
    if prompt is None:
        raise invalid("`prompt` is required", "prompt")
    if isinstance(prompt, str):
        return prompt, None
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], None
    # [[ids]]: one prompt of token ids.
    ids = prompt[0] if len(prompt) == 1 and isinstance(prompt[0], list) else prompt
    # `type(...) is int`: JSON's true and false are not token ids.
    if ids and all(type(item) is int for item in ids):
        return None, list(ids)
    raise invalid(
        "`prompt` must be a string, an array of one string, or an array of token ids "
        "(one prompt per request)",
        "prompt",
    )


def _generate(
    request: _SamplingFields,
    served_model: str,
    max_tokens: int | None,
    **prompt: Any,
) -> Generate:
    if request.model is not None and request.model != served_model:
        raise model_not_found(request.model, served_model, "model")
    if request.n not in (None, 1):
        raise invalid("n must be 1 (one choice per request)", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name) not in (None, 0):
            raise invalid(f"{name} is not supported by this server (only 0)", name)
    if request.logit_bias:
        raise invalid("logit_bias is not supported by this server", "logit_bias")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    # vLLM's "no top-k" is -1; orcapod's is 0.
    top_k = 0 if request.top_k in (None, -1) else request.top_k
    return Generate(
        id=HTTP_CLIENT_ID,
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=top_k,
        seed=request.seed,
        stop=stop,
        ignore_eos=bool(request.ignore_eos),
        min_tokens=request.min_tokens or 0,
        **prompt,
    )


def _parsed(kind: Kind, request: _SamplingFields, generate: Generate) -> ParsedRequest:
    options = request.stream_options
    if options is not None and not request.stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    return ParsedRequest(kind, generate, bool(request.stream), include_usage, continuous_usage)


# --- responses -----------------------------------------------------------------------


class _ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct, frozen=True):
    error: _ErrorDetail


class UsageOut(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Known at the end (the prefix cache's share): absent from a chunk's usage so far.
    prompt_tokens_details: PromptTokensDetails | msgspec.UnsetType = msgspec.UNSET


class _Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class _Message(msgspec.Struct, frozen=True):
    role: str
    content: str


class _ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: _Message
    logprobs: None
    finish_reason: str


class _ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: _Delta
    logprobs: None
    finish_reason: str | None


class _TextChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class _Response(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[_ChatChoice] | list[_ChatChunkChoice] | list[_TextChoice]
    usage: UsageOut | msgspec.UnsetType | None = msgspec.UNSET


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
        return self._event(_Delta(role="assistant", content=""), None, self._usage_so_far(0))

    def token(self, text: str, num_completion_tokens: int) -> bytes:
        """One token's text, the request's ``num_completion_tokens``-th: an event
        when streaming (none for empty text), else kept."""
        if not self._parsed.stream:
            self._texts.append(text)
            return b""
        if not text:
            return b""
        usage = self._usage_so_far(num_completion_tokens)
        return self._event(_Delta(content=text), None, usage, text)

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
                choices = [_ChatChoice(0, _Message("assistant", text), None, finish_reason)]
                kind = "chat.completion"
            else:
                choices = [_TextChoice(0, text, None, finish_reason)]
                kind = "text_completion"
            return _encoder.encode(
                _Response(self._id, kind, self._created, self._model, choices, usage)
            )
        usage_so_far = self._usage_so_far(done.usage.completion_tokens)
        events = self._event(_Delta(), finish_reason, usage_so_far)
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
        delta: _Delta,
        finish_reason: str | None,
        usage: UsageOut | msgspec.UnsetType | None,
        text: str = "",
    ) -> bytes:
        choice: Any
        if self.is_chat:
            choice = _ChatChunkChoice(0, delta, None, finish_reason)
        else:
            choice = _TextChoice(0, text, None, finish_reason)
        return _sse(self._response([choice], usage))

    def _response(
        self, choices: list[Any], usage: UsageOut | msgspec.UnsetType | None
    ) -> _Response:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        return _Response(self._id, kind, self._created, self._model, choices, usage)


def finish_reason_of(done: Done) -> str:
    """OpenAI's finish_reason; a request the gateway cancelled itself reads as
    ``abort``, as vLLM reports it."""
    return "abort" if done.finish_reason == "cancelled" else done.finish_reason


def error_of_frame(error: Error) -> OpenAIError:
    """The core's ``error`` frame, as OpenAI's error: ``param`` names the field
    its message starts with (the core's messages name the field first)."""
    translated = error_of_code(error.code, error.message)
    translated.param = _param_of_core_message(error.message)
    return translated


# The fields of a generate that are OpenAI fields too; prompt_token_ids is
# OpenAI's `prompt` given as token ids.
_PARAMS = {
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "messages": "messages",
    "prompt": "prompt",
    "prompt_token_ids": "prompt",
}


def _param_of_core_message(message: str) -> str | None:
    """``max_tokens`` from "max_tokens 0 is below 1", ``stop`` from "`stop` has
    17 strings", ``prompt`` from "prompt_token_ids[3] is ..."; None otherwise."""
    first = message.split(" ", 1)[0].strip("`").split("[", 1)[0].split(".", 1)[0]
    return _PARAMS.get(first)


def _sse(response: _Response) -> bytes:
    return b"data: " + _encoder.encode(response) + b"\n\n"


# --- models --------------------------------------------------------------------------


class _Model(msgspec.Struct, frozen=True):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class _ModelList(msgspec.Struct, frozen=True):
    object: str
    data: list[_Model]


def models_body(served_model: str, context_tokens: int, created: int) -> bytes:
    """``GET /v1/models``: the one model this service serves."""
    return _encoder.encode(_ModelList("list", [_model(served_model, context_tokens, created)]))


def model_body(served_model: str, context_tokens: int, created: int) -> bytes:
    """``GET /v1/models/{model}``: the model, as ``GET /v1/models`` lists it."""
    return _encoder.encode(_model(served_model, context_tokens, created))


def _model(served_model: str, context_tokens: int, created: int) -> _Model:
    return _Model(served_model, "model", created, "orcapod", context_tokens)
