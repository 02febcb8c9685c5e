"""Doors the audit of fa199bb found open on a real ``orcapod up``, each shut:
an HTTP stream taken over by ``resume``, a revoked key's SSE stream running
on, a repeated credential header answered with a 500 and a traceback, a
``text/plain`` POST (what any page may send without asking) served,
``--allowed-origin`` shutting out the gateway's own pages, and a tenants
file's ``cache_group`` ignored."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from typing import Any

import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.adversarial.service import (
    ALLOWED_ORIGIN,
    INTERNALS,
    KEYS,
    Client,
    Service,
    open_socket,
)

MODEL = "SmolLM2-135M-Instruct"
# Streams long enough to be interrupted: 60 tokens, the end of text ignored.
LONG = {"max_tokens": 60, "temperature": 0, "extra_body": {"ignore_eos": True}}
QUESTION: list[Any] = [{"role": "user", "content": "Count from one to a hundred."}]


def async_client(service: Service, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{service.port}/v1",
        api_key=KEYS[tenant],
        max_retries=0,
        timeout=60,
    )


def test_an_http_stream_cannot_be_taken_over_by_resume(service: Service) -> None:
    """The id in ``chatcmpl-<request_id>`` resumed on a websocket of the same
    tenant: the socket is told no, the HTTP client keeps every token."""

    async def scenario() -> tuple[dict[str, Any], int, str | None]:
        client = async_client(service, "victim")
        stream = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, stream=True, **LONG
        )
        chunks = []
        refusal: dict[str, Any] = {}
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 2:
                request_id = chunk.id.removeprefix("chatcmpl-")
                async with open_socket(service, "victim") as socket:
                    thief = Client(socket)
                    resume = {"type": "resume", "request_id": request_id, "id": "stolen"}
                    await thief.send(resume)
                    outcome = await thief.until_end("stolen", timeout_s=30)
                    assert not outcome.tokens
                    refusal = outcome.frames[-1]
        await client.close()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return refusal, len(text), finish

    refusal, num_chars, finish = asyncio.run(scenario())
    assert refusal["type"] == "error" and refusal["code"] == "invalid_request"
    assert "came over HTTP" in refusal["message"]
    # Every token reached the HTTP client, to the end (no cut stream).
    assert finish == "length" and num_chars > 60


def test_a_revoked_keys_http_stream_ends_with_an_error_event_and_done(service: Service) -> None:
    async def scenario() -> tuple[list[str], float]:
        headers = {"Authorization": f"Bearer {KEYS['doomed']}", "Content-Type": "application/json"}
        body = {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 2000}
        body["ignore_eos"] = True
        reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
        data = json.dumps(body).encode()
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        # Tokens flow; then the key leaves the file.
        await reader.readuntil(b"data: ")
        service.write_tenants([name for name in KEYS if name != "doomed"])
        revoked_s = time.monotonic()
        async with asyncio.timeout(30):
            rest = (await reader.read()).decode()
        writer.close()
        events = [line.removeprefix("data: ") for line in rest.splitlines() if line]
        return events, time.monotonic() - revoked_s

    try:
        events, ended_s = asyncio.run(scenario())
    finally:
        service.write_tenants(list(KEYS))
        time.sleep(3)
    print(f"revoked key's SSE stream ended {ended_s:.1f} s after the file changed")
    data = [event for event in events if event.startswith("{") or event == "[DONE]"]
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["type"] == "authentication_error" and error["message"] == "API key revoked"
    # The reload comes within 2 s; far before the 2,000 tokens would have.
    assert ended_s < 10


@pytest.mark.parametrize("name", ["Authorization", "Origin", "Host"])
def test_a_repeated_credential_or_origin_header_is_a_400_not_a_500(
    service: Service, name: str
) -> None:
    values = {
        "Authorization": (f"Bearer {KEYS['victim']}", "Bearer key-other"),
        "Origin": (f"http://127.0.0.1:{service.port}", "http://evil.example"),
        "Host": ("127.0.0.1", "attacker.example"),
    }[name]
    for path in ("/v1/models", "/ws"):
        connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10)
        connection.putrequest("GET", path, skip_host=True)
        if name != "Host":
            connection.putheader("Host", "127.0.0.1")
            connection.putheader("Authorization", f"Bearer {KEYS['victim']}")
        for value in values:
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        body = response.read().decode()
        connection.close()
        assert response.status == 400, (path, response.status, body)
        assert not INTERNALS.search(body)
    assert service.up is not None
    logged = "\n".join(service.up.drain())
    # Told in one line each, never a traceback (anyone could fill the log).
    assert "MultipleValuesError" not in logged and "Traceback" not in logged


def test_a_body_any_page_could_send_is_refused(service: Service) -> None:
    """``text/plain`` and forms need no CORS preflight: with them a page of
    any site could drive the API of a gateway it reaches."""
    body = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 4})
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=30)
        headers = {"Authorization": f"Bearer {KEYS['victim']}", "Content-Type": content_type}
        connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
        response = connection.getresponse()
        reply = json.loads(response.read())
        connection.close()
        assert response.status == 415, content_type
        assert reply["error"]["code"] == "unsupported_media_type"


def test_allowed_origins_add_to_the_gateways_own(service: Service) -> None:
    """Started with ``--allowed-origin``: that site's pages and the gateway's
    own (chat, dashboard) both open sockets; another site's do not."""

    async def handshake(origin: str) -> int:
        headers = {"Authorization": f"Bearer {KEYS['victim']}", "Origin": origin}
        try:
            async with connect(service.url, additional_headers=headers, open_timeout=10):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    own = f"http://127.0.0.1:{service.port}"
    assert asyncio.run(handshake(ALLOWED_ORIGIN)) == 101
    assert asyncio.run(handshake(own)) == 101
    assert asyncio.run(handshake("https://evil.example")) == 403


def test_tenants_of_one_cache_group_share_cached_prefixes(service: Service) -> None:
    """``cache_group`` in the tenants file: team_b hits what team_a cached;
    the victim (no group) still does not."""
    system = " ".join(f"Team rule {i}: be brief, be kind, cite sources." for i in range(20))
    messages: list[Any] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which rule is first?"},
    ]

    def cached_tokens(tenant: str) -> int:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{service.port}/v1", api_key=KEYS[tenant], max_retries=0
        )
        completion = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, temperature=0
        )
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    assert cached_tokens("team_a") == 0
    assert cached_tokens("team_b") >= 128
    assert cached_tokens("victim") == 0
