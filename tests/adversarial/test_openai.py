"""The OpenAI API of a real ``orcapod up`` (the real model, keys, tenants), with
the official ``openai`` client: the same service as the websocket, the same
answers, the same keys; bad input answered in OpenAI's shape, and a client
that goes away frees its request at once."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from typing import Any

import openai
import pytest

from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import RequestEnded, decode_log_entry
from tests.adversarial.service import KEYS, PREFIX, Service, open_socket
from tests.adversarial.service import Client as SocketClient

MODEL = "SmolLM2-135M-Instruct"
QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


def base_url(service: Service) -> str:
    return f"http://127.0.0.1:{service.port}/v1"


def client_of(service: Service, tenant: str = "victim") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(service), api_key=KEYS[tenant], max_retries=0)


async def websocket_answer(service: Service, **fields: Any) -> str:
    async with open_socket(service, "victim") as socket:
        outcome = await SocketClient(socket).ask("q", **fields)
    assert outcome.end is not None and outcome.end["type"] == "done", outcome.frames
    return "".join(token["text"] for token in outcome.tokens)


def test_the_openai_client_gets_the_websockets_greedy_answer(service: Service) -> None:
    expected = asyncio.run(websocket_answer(service, messages=QUESTION, max_tokens=24))
    assert "Paris" in expected
    client = client_of(service)
    assert [model.id for model in client.models.list().data] == [MODEL]
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0
    )
    assert completion.choices[0].message.content == expected
    assert completion.usage is not None and completion.usage.total_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens
    # Completions: the same prompt text, the same continuation as the websocket's.
    prompt = "The capital of France is"
    expected_text = asyncio.run(websocket_answer(service, prompt=prompt, max_tokens=8))
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert text.choices[0].text == expected_text
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected_text


def test_keys_and_errors_reach_the_client_as_openai_errors(service: Service) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url(service), api_key="key-wrong", max_retries=0).models.list()
    client = client_of(service)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=2)
    assert refused.value.body is not None and "n must be 1" in str(refused.value.body)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 9000}], max_tokens=10
        )
    assert too_long.value.code == "context_length_exceeded"


BAD_BODIES: list[bytes] = [
    b"{",
    b'{"messages": "hi"}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
    b'{"messages": [{"role": "user", "content": "x"}], "top_p": 5e-324, "max_tokens": 1e3}',
    b'{"messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551616}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "x"}], "top_k": -2}',
    b'{"messages": [{"role": "user", "content": "x"}], "stop": [""]}',
    b'{"messages": [{"role": "user", "content": "x"}], "unknown": 1}',
    b'{"prompt": [99999999999]}',
    b"[" * 100_000,
    b'{"messages": [' + b'{"role": "user", "content": "x"},' * 600 + b'{"role":"user"}]}',
]  # fmt: skip


def post(
    service: Service, path: str, body: bytes, tenant: str | None = "attacker"
) -> tuple[int, Any]:
    """One POST on its own connection; the status and the JSON answer."""
    connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if tenant is not None:
        headers["Authorization"] = f"Bearer {KEYS[tenant]}"
    try:
        connection.request("POST", f"/v1{path}", body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_bad_bodies_get_openai_errors_and_every_process_survives(service: Service) -> None:
    for body in BAD_BODIES:
        path = "/completions" if body.startswith(b'{"prompt"') else "/chat/completions"
        status, reply = post(service, path, body)
        assert status == 400, (body[:80], reply)
        error = reply["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
    status, _ = post(service, "/chat/completions", b"{" + b" " * (2 << 20) + b"}")
    assert status == 413
    status, reply = post(service, "/chat/completions", b"{}", tenant=None)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    # The victim is served all the same.
    answer = client_of(service).chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0
    )
    assert answer.choices[0].message.content


def test_a_client_that_goes_away_frees_its_request_at_once(service: Service) -> None:
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body),
        headers={"Authorization": f"Bearer {KEYS['victim']}", "Content-Type": "application/json"},
    )
    response = connection.getresponse()
    assert response.status == 200
    events = [response.readline() for _ in range(8)]
    first = json.loads(next(line for line in events if line.startswith(b"data: "))[6:])
    request_id = first["id"].removeprefix("chatcmpl-")
    connection.close()
    left_s = time.monotonic()
    # Leaving the stream closed the connection: the gateway cancels upstream and
    # records in the request's log how far the client got.
    store = service.redis()
    log_key = RedisKeys(PREFIX).request_log(request_id)
    while True:
        entries = [decode_log_entry(f[MESSAGE_FIELD.encode()]) for _, f in store.xrange(log_key)]
        ended = [entry for entry in entries if isinstance(entry, RequestEnded)]
        if ended:
            break
        assert time.monotonic() - left_s < 5.0, "the request was not cancelled"
        time.sleep(0.05)
    assert ended[0].num_tokens < 2000
