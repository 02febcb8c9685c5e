"""OpenAI's bodies in orcapod's terms and orcapod's frames in OpenAI's, pure."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import pytest

from gateway.openai_api import parse_chat, parse_completion
from gateway.openai_errors import (
    OpenAIError,
    error_of_code,
    error_of_frame,
    invalid,
    model_not_found,
    shutting_down,
    unauthorized,
)
from gateway.openai_reply import SSE_DONE, Reply, model_body, models_body
from shared.protocol import ChatMessage, Done, Error, Timings, Usage

MODEL = "m"


def chat(**fields: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_chat_fields_map_onto_a_generate() -> None:
    parsed = parse_chat(
        chat(
            model=MODEL,
            max_completion_tokens=9,
            max_tokens=3,
            temperature=0,
            top_p=0.5,
            seed=4,
            stop="END",
            top_k=-1,
            min_tokens=2,
            ignore_eos=True,
            user="someone",
            stream=True,
            stream_options={"include_usage": True},
        ),
        MODEL,
    )
    generate = parsed.generate
    assert (generate.max_tokens, generate.temperature, generate.top_p) == (9, 0, 0.5)
    assert (generate.seed, generate.stop, generate.top_k) == (4, ["END"], 0)
    assert (generate.min_tokens, generate.ignore_eos) == (2, True)
    assert parsed.stream and parsed.include_usage and parsed.kind == "chat"


def test_chat_defaults_are_openais() -> None:
    generate = parse_chat(chat(), MODEL).generate
    # No max_tokens: what the context leaves (resolved after tokenizing).
    assert generate.max_tokens is None
    assert (generate.temperature, generate.top_p, generate.top_k) == (1.0, 1.0, 0)
    assert generate.stop == []


def test_content_parts_and_roles() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": parts},
        ]
    }
    generate = parse_chat(json.dumps(body).encode(), MODEL).generate
    assert generate.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="ab"),
    ]


# What `continuous_usage_stats` must not be.
NOT_BOOLEANS: list[Any] = ["true", 1, None, []]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (chat(n=2), HTTPStatus.BAD_REQUEST, "n"),
        (chat(logprobs=True), HTTPStatus.BAD_REQUEST, "logprobs"),
        (chat(top_logprobs=2), HTTPStatus.BAD_REQUEST, "logprobs"),
        (chat(frequency_penalty=1), HTTPStatus.BAD_REQUEST, "frequency_penalty"),
        (chat(logit_bias={"1": 5}), HTTPStatus.BAD_REQUEST, "logit_bias"),
        (chat(response_format={"type": "json_object"}), HTTPStatus.BAD_REQUEST, "response_format"),
        (chat(tool_choice="required"), HTTPStatus.BAD_REQUEST, "tool_choice"),
        (chat(model="other"), HTTPStatus.NOT_FOUND, "model"),
        (chat(temperature="1"), HTTPStatus.BAD_REQUEST, "temperature"),
        (chat(stream_options={"include_usage": True}), HTTPStatus.BAD_REQUEST, "stream_options"),
        (chat(stream=True, stream_options={"x": 1}), HTTPStatus.BAD_REQUEST, "stream_options"),
        *[(chat(stream=True, stream_options={"include_usage": True,
                                             "continuous_usage_stats": value}),
           HTTPStatus.BAD_REQUEST, "stream_options.continuous_usage_stats")
          for value in NOT_BOOLEANS],
        (b'{"messages": [{"role": "user"}]}', HTTPStatus.BAD_REQUEST, "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}',
         HTTPStatus.BAD_REQUEST, "messages[0].tool_calls"),
        (b'{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}',
         HTTPStatus.BAD_REQUEST, "messages[0].content[0]"),
        (b"{}", HTTPStatus.BAD_REQUEST, "messages"),
        (b"   ", HTTPStatus.BAD_REQUEST, None),
        (b"[" * 50_000, HTTPStatus.BAD_REQUEST, None),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused(
    body: bytes, status: HTTPStatus, param: str | None
) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse_chat(body, MODEL)
    assert refused.value.status == status
    assert refused.value.param == param
    error = json.loads(refused.value.body())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [("hi", "hi", None), (["hi"], "hi", None), ([1, 2], None, [1, 2]), ([[3, 4]], None, [3, 4])],
)
def test_completion_prompt_forms(prompt: Any, text: str | None, ids: list[int] | None) -> None:
    generate = parse_completion(json.dumps({"prompt": prompt}).encode(), MODEL).generate
    assert (generate.prompt, generate.prompt_token_ids) == (text, ids)
    assert generate.max_tokens == 16


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["a", "b"]},
        {"prompt": [[1], [2]]},
        {"prompt": [True]},
        {"prompt": []},
        {"prompt": [["a"]]},
        {"prompt": "x", "echo": True},
        {"prompt": "x", "logprobs": 1},
        {"prompt": "x", "best_of": 2},
        {"prompt": "x", "suffix": "y"},
    ],
)
def test_completion_refusals(body: dict[str, Any]) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse_completion(json.dumps(body).encode(), MODEL)
    assert refused.value.status == HTTPStatus.BAD_REQUEST


def test_codes_map_to_statuses() -> None:
    statuses = {
        "invalid_request": 400,
        "prompt_too_long": 400,
        "unauthorized": 401,
        "queue_full": 429,
        "internal": 500,
    }
    for code, status in statuses.items():
        assert error_of_code(code, "m").status == status  # type: ignore[arg-type]
    assert error_of_code("prompt_too_long", "m").code == "context_length_exceeded"


def test_a_core_refusal_answers_with_the_data_it_came_with() -> None:
    """``param`` and a draining gateway's 503 come from the refusal, never from its prose."""
    frame = Error(code="invalid_request", message="max_tokens 0 is below 1", id="http")
    assert error_of_frame(frame).param is None
    assert error_of_frame(frame, param="max_tokens").param == "max_tokens"
    draining = Error(code="queue_full", message="gateway is shutting down", id="http")
    assert error_of_frame(draining).status == HTTPStatus.TOO_MANY_REQUESTS
    refused = error_of_frame(draining, reason="shutting_down")
    assert refused.status == HTTPStatus.SERVICE_UNAVAILABLE
    assert json.loads(refused.body())["error"] == json.loads(shutting_down().body())["error"]
    assert refused.metric_code == "service_unavailable"


DONE = Done(id="http", finish_reason="stop", usage=Usage(3, 2), timings=Timings(1.0, 2.0))


def events(data: bytes) -> list[Any]:
    chunks = data.decode().split("\n\n")
    assert chunks[-1] == ""
    return [c.removeprefix("data: ") for c in chunks[:-1]]


def test_a_streamed_chat_reply() -> None:
    parsed = parse_chat(chat(stream=True, stream_options={"include_usage": True}), MODEL)
    reply = Reply(parsed, MODEL, "r1", num_prompt_tokens=3, created=5)
    data = reply.head() + reply.token("He", 1) + reply.token("", 2) + reply.token("y", 2)
    data += reply.done(DONE)
    *chunks, last = events(data)
    assert last == "[DONE]"
    decoded = [json.loads(chunk) for chunk in chunks]
    assert {d["id"] for d in decoded} == {"chatcmpl-r1"}
    assert {d["object"] for d in decoded} == {"chat.completion.chunk"}
    assert decoded[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [d["choices"][0]["delta"].get("content") for d in decoded[1:3]] == ["He", "y"]
    assert decoded[3]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert all(d["usage"] is None for d in decoded[:4])
    assert decoded[4]["choices"] == [] and decoded[4]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    error = OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, "boom", type="server_error")
    assert events(reply.stream_error(error))[-1] == "[DONE]"
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_whole_replies() -> None:
    reply = Reply(parse_chat(chat(), MODEL), MODEL, "r2", num_prompt_tokens=3, created=5)
    reply.token("Hel", 1)
    reply.token("lo", 2)
    body = json.loads(reply.done(DONE))
    assert body["object"] == "chat.completion" and body["created"] == 5
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"]["total_tokens"] == 5
    text = Reply(parse_completion(b'{"prompt": "x"}', MODEL), MODEL, "r3", num_prompt_tokens=1)
    text.token("ok", 1)
    cancelled = Done("http", "cancelled", Usage(1, 1), Timings(None, 1.0))
    body = json.loads(text.done(cancelled))
    assert body["id"] == "cmpl-r3" and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "ok" and body["choices"][0]["finish_reason"] == "abort"
    # A streamed completion has no usage field unless asked for.
    streamed_completion = parse_completion(b'{"prompt": "x", "stream": true}', MODEL)
    streamed = Reply(streamed_completion, MODEL, "r4", num_prompt_tokens=1)
    assert streamed.head() == b""
    chunk = json.loads(events(streamed.token("a", 1))[0])
    assert "usage" not in chunk and chunk["choices"][0]["text"] == "a"


def test_null_is_every_fields_default() -> None:
    nulls = dict.fromkeys(
        ["model", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
         "frequency_penalty", "presence_penalty", "logit_bias", "user", "top_k", "ignore_eos",
         "min_tokens", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
         "tools", "tool_choice", "parallel_tool_calls", "response_format"]
    )  # fmt: skip
    parsed = parse_chat(chat(**nulls), MODEL)
    assert parsed.generate == parse_chat(chat(), MODEL).generate
    assert not parsed.stream


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk() -> None:
    parsed = parse_chat(chat(stream=True, stream_options=CONTINUOUS), MODEL)
    assert parsed.include_usage and parsed.continuous_usage
    reply = Reply(parsed, MODEL, "r1", num_prompt_tokens=3, created=5)
    data = reply.head() + reply.token("He", 1) + reply.token("", 2) + reply.token("y", 2)
    data += reply.done(DONE)
    *chunks, last = events(data)
    assert last == "[DONE]"
    decoded = [json.loads(chunk) for chunk in chunks]
    # The role, "He", "y", the finish, then the whole usage alone (as without).
    assert [d["usage"] for d in decoded[:4]] == [usage(3, 0), usage(3, 1), usage(3, 2), usage(3, 2)]
    assert decoded[3]["choices"][0]["finish_reason"] == "stop"
    assert decoded[4]["choices"] == []
    assert decoded[4]["usage"] == {**usage(3, 2), "prompt_tokens_details": {"cached_tokens": 0}}

    completion = parse_completion(
        json.dumps({"prompt": "x", "stream": True, "stream_options": CONTINUOUS}).encode(), MODEL
    )
    text = Reply(completion, MODEL, "r2", num_prompt_tokens=1)
    data = text.head() + text.token("a", 1) + text.token("b", 2)
    data += text.done(Done("http", "length", Usage(1, 2), Timings(1.0, 2.0)))
    decoded = [json.loads(chunk) for chunk in events(data)[:-1]]
    assert [d["choices"][0]["text"] for d in decoded[:3]] == ["a", "b", ""]
    assert [d["usage"] for d in decoded[:3]] == [usage(1, 1), usage(1, 2), usage(1, 2)]
    assert decoded[3]["choices"] == [] and decoded[3]["usage"]["total_tokens"] == 3


@pytest.mark.parametrize(
    "stream_options",
    [
        {"include_usage": True, "continuous_usage_stats": False},
        {"include_usage": True},
        # As vLLM takes it: without include_usage, no usage at all.
        {"continuous_usage_stats": True},
        {"include_usage": False, "continuous_usage_stats": True},
    ],
)
def test_without_continuous_usage_only_the_last_chunk_has_it(
    stream_options: dict[str, bool],
) -> None:
    parsed = parse_chat(chat(stream=True, stream_options=stream_options), MODEL)
    assert not parsed.continuous_usage
    reply = Reply(parsed, MODEL, "r1", num_prompt_tokens=3)
    data = reply.head() + reply.token("He", 1) + reply.done(DONE)
    decoded = [json.loads(chunk) for chunk in events(data)[:-1]]
    with_choices = [d for d in decoded if d["choices"]]
    assert len(with_choices) == 3
    if parsed.include_usage:
        assert all(d["usage"] is None for d in with_choices)
        assert decoded[-1]["usage"]["completion_tokens"] == 2
    else:
        assert not any("usage" in d for d in decoded)


def test_one_model_is_the_one_listed() -> None:
    listed = json.loads(models_body(MODEL, 8192, 5))["data"]
    assert listed == [json.loads(model_body(MODEL, 8192, 5))]
    assert listed[0]["id"] == MODEL and listed[0]["object"] == "model"
    missing = model_not_found("org/other", MODEL, None)
    assert missing.status == HTTPStatus.NOT_FOUND
    error = json.loads(missing.body())["error"]
    assert error == {
        "message": error["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }


def test_each_refusal_is_counted_under_its_code() -> None:
    forbidden = OpenAIError(HTTPStatus.FORBIDDEN, "m", type="permission_error")
    codes = {
        "invalid_request": [invalid("m", "n"), OpenAIError(HTTPStatus.BAD_REQUEST, "m")],
        "model_not_found": [model_not_found("x", MODEL, "model")],
        "invalid_api_key": [unauthorized("m")],
        "forbidden": [forbidden],
        "not_found": [OpenAIError(HTTPStatus.NOT_FOUND, "m")],
        "method_not_allowed": [OpenAIError(HTTPStatus.METHOD_NOT_ALLOWED, "m")],
        "context_length_exceeded": [error_of_code("prompt_too_long", "m")],
    }
    for code, errors in codes.items():
        assert [error.metric_code for error in errors] == [code] * len(errors)
