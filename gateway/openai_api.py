"""OpenAI's Chat Completions and Completions request bodies, parsed into
orcapod's terms. Pure: the bytes of a body in, a ``ParsedRequest`` (its
``generate``) or an ``OpenAIError`` (``gateway/openai_errors.py``) out.

Everything a ``generate`` is checked for (ranges, caps, the context) stays in
``gateway/validation.py``: this module only says what OpenAI's fields mean in
orcapod's terms, and refuses clearly what orcapod cannot honour (``n`` > 1,
``logprobs``, tools, penalties) instead of ignoring it. Unknown fields are
refused too, so a typo never silently changes nothing.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from gateway.openai_errors import invalid, model_not_found
from gateway.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    Kind,
    MessageIn,
    ParsedRequest,
    SamplingFields,
)
from shared.protocol import ChatMessage, Generate

# The id every HTTP request's generate has on its own (one-request) socket.
HTTP_CLIENT_ID = "http"

_Body = TypeVar("_Body", ChatCompletionRequest, CompletionRequest)


def parse_chat(body: bytes, served_model: str) -> ParsedRequest:
    """A ``POST /v1/chat/completions`` body; raises OpenAIError."""
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
    """A ``POST /v1/completions`` body; raises OpenAIError."""
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
    """``messages[0].role`` from msgspec's ``... - at `$.messages[0].role```
    (msgspec gives the path only in its message)."""
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
    request: SamplingFields,
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


def _parsed(kind: Kind, request: SamplingFields, generate: Generate) -> ParsedRequest:
    options = request.stream_options
    if options is not None and not request.stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    return ParsedRequest(kind, generate, bool(request.stream), include_usage, continuous_usage)
