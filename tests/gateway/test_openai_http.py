"""The OpenAI API on the gateway's port, end to end: a real GatewayServer, real
redis-server, the official ``openai`` client and aiohttp's HTTP client on
loopback. The test plays the scheduler and the worker (``FakeUpstream``).
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yarl
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from gateway.openai_errors import shutting_down
from gateway.server import GatewayServer
from gateway.tenants import Tenant, hash_key, tenant_toml
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.messages import RequestRejected, encode
from tests.conftest import RedisServer
from tests.gateway.test_server import (
    GATEWAY_ID,
    KEYS,
    TIMEOUT_S,
    FakeUpstream,
    accept,
    receive_until_done,
    run_with_gateway,
    running_gateway,
)
from tests.gateway.worker_tokens import worker_tokens

MODEL = "SmolLM2-135M-Instruct"
CHAT: list[Any] = [{"role": "user", "content": "Say hi"}]


def client_of(server: GatewayServer, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.http_url}/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT_S
    )


async def post(
    server: GatewayServer, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POST ``body`` (bytes as they are, anything else as JSON); the status and JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{server.http_url}{path}",
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as response,
    ):
        return response.status, await response.json(content_type=None)


async def get(server: GatewayServer, path: str) -> tuple[int, Any]:
    """GET ``path`` exactly as written (percent-escapes and all); the status and JSON."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(yarl.URL(f"{server.http_url}{path}", encoded=True)) as response,
    ):
        return response.status, await response.json(content_type=None)


async def send_post(
    server: GatewayServer, path: str, body: Any, receive_buffer_bytes: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A POST written on a plain connection, not read: a client that may go away."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer_bytes is not None:
        # Set before connecting: the window it offers stays that small.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return reader, writer


def test_chat_and_completions_with_the_openai_client_streaming_and_not(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        client = client_of(server)
        models = await client.models.list()
        assert [model.id for model in models.data] == [MODEL]

        # Not streaming: one body, the usage counted by the service.
        call = asyncio.create_task(
            client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=8, temperature=0, seed=7
            )
        )
        submit = await upstream.next_submit()
        assert submit.sampling.temperature == 0 and submit.sampling.seed == 7
        assert submit.sampling.max_tokens == 8
        assert submit.prompt_ids == chat_tokenizer.encode_chat(CHAT, add_generation_prompt=True)
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "Hello there"))
        completion = await call
        assert completion.choices[0].message.content == "Hello there"
        assert completion.choices[0].finish_reason == "length"
        assert completion.id == f"chatcmpl-{submit.request_id}"
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == len(submit.prompt_ids)
        assert completion.usage.completion_tokens == len(
            chat_tokenizer.encode("Hello there", add_special_tokens=False)
        )

        # Streaming, with the usage chunk before [DONE].
        async def stream_chat() -> list[Any]:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=100,
                stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in stream]

        call_stream = asyncio.create_task(stream_chat())
        submit = await upstream.next_submit()
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "One two", "stop"))
        chunks = await call_stream
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "One two"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert not chunks[-1].choices and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 2

        # Completions: a text prompt (streamed), and token ids.
        async def stream_completion() -> str:
            stream = await client.completions.create(
                model=MODEL, prompt="Once upon", max_tokens=5, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream])

        call_text = asyncio.create_task(stream_completion())
        submit = await upstream.next_submit()
        assert submit.prompt_ids == chat_tokenizer.encode("Once upon", add_special_tokens=True)
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, " a time"))
        assert await call_text == " a time"
        call_ids = asyncio.create_task(
            client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
        )
        submit = await upstream.next_submit()
        assert submit.prompt_ids == [1, 2, 3]
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "ok"))
        assert (await call_ids).choices[0].text == "ok"
        await client.close()

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_a_model_is_retrieved_by_its_id_and_an_unknown_id_is_a_404(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        client = client_of(server)
        listed = await client.models.list()
        model = await client.models.retrieve(MODEL)
        assert model == listed.data[0] and model.id == MODEL
        # Every character percent-encoded is the same id.
        encoded = "".join(f"%{byte:02X}" for byte in MODEL.encode())
        status, reply = await get(server, f"/v1/models/{encoded}")
        _, models = await get(server, "/v1/models")
        assert status == 200 and reply == models["data"][0]
        # The client sends `/` as %2F, `?` as %3F, `#` as %23.
        unknown = ["HuggingFaceTB/" + MODEL, MODEL + "/", MODEL.lower(), "gpt-4o", "a b%c?d#e"]
        for model_id in unknown:
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve(model_id)
            assert missing.value.code == "model_not_found", model_id
            assert missing.value.type == "invalid_request_error" and missing.value.param is None
        # A `/` sent as it is stays in the id (a missing route would have no code).
        for path in ("HuggingFaceTB/" + MODEL, MODEL + "/", MODEL + "/x"):
            status, reply = await get(server, f"/v1/models/{path}")
            assert status == 404 and reply["error"]["code"] == "model_not_found", path
        status, reply = await get(server, "/v1/models/")
        assert status == 404 and reply["error"]["code"] is None
        await client.close()
        counts = error_counts(await scrape(server))
        assert counts == {"model_not_found": len(unknown) + 3, "not_found": 1}

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def usage_of(chunk: Any) -> tuple[int, int, int]:
    """A streamed chunk's prompt, completion and total tokens (it must have them)."""
    assert chunk.usage is not None, chunk
    usage = chunk.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    continuous: Any = {"include_usage": True, "continuous_usage_stats": True}

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        client = client_of(server)

        async def stream_chat() -> list[Any]:
            stream = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=50, stream=True, stream_options=continuous
            )
            return [chunk async for chunk in stream]

        call = asyncio.create_task(stream_chat())
        submit = await upstream.next_submit()
        tokens = worker_tokens(chat_tokenizer, submit.request_id, "One two three", "stop")
        await upstream.publish(*tokens)
        chunks = await call
        num_prompt_tokens, num_tokens = len(submit.prompt_ids), len(tokens)
        usages = [usage_of(chunk) for chunk in chunks]
        assert {prompt_tokens for prompt_tokens, _, _ in usages} == {num_prompt_tokens}
        # The role, one chunk per token, the finish, then the usage alone.
        expected = [0, *range(1, num_tokens + 1), num_tokens, num_tokens]
        assert [completion_tokens for _, completion_tokens, _ in usages] == expected
        assert [bool(chunk.choices) for chunk in chunks] == [True] * (num_tokens + 2) + [False]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0

        async def stream_completion() -> list[Any]:
            stream = await client.completions.create(
                model=MODEL,
                prompt="Once upon",
                max_tokens=5,
                stream=True,
                stream_options=continuous,
            )
            return [chunk async for chunk in stream]

        call_text = asyncio.create_task(stream_completion())
        submit = await upstream.next_submit()
        tokens = worker_tokens(chat_tokenizer, submit.request_id, " a time")
        await upstream.publish(*tokens)
        usages = [usage_of(chunk) for chunk in await call_text]
        num_tokens = len(tokens)
        expected = [*range(1, num_tokens + 1), num_tokens, num_tokens]
        assert [completion_tokens for _, completion_tokens, _ in usages] == expected
        assert {prompt_tokens for prompt_tokens, _, _ in usages} == {len(submit.prompt_ids)}

        # Anything but a boolean is a 400 naming the field; nothing reaches the scheduler.
        not_booleans: list[Any] = ["true", 1, None, {}]
        for value in not_booleans:
            options: Any = {"include_usage": True, "continuous_usage_stats": value}
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(
                    model=MODEL, prompt="x", stream=True, stream_options=options
                )
            assert refused.value.param == "stream_options.continuous_usage_stats", value
        assert await upstream.redis.xlen(KEYS.requests) == 2
        await client.close()

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


BAD_BODIES: list[tuple[str, bytes | dict[str, Any], int, str | None]] = [
    ("malformed JSON", b'{"messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("empty body", b"", 400, None),
    ("unknown field", {"messages": CHAT, "temprature": 0.5}, 400, None),
    ("wrong type", {"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("infinite temperature", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"temperature": 1e999}', 400, None),
    ("temperature below 0", {"messages": CHAT, "temperature": -0.1}, 400, "temperature"),
    ("top_p 0", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("max_tokens 0", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", {"messages": CHAT, "max_tokens": 2**70}, 400, None),
    ("negative seed", {"messages": CHAT, "seed": -1}, 400, "seed"),
    ("min over max", {"messages": CHAT, "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("n 2", {"messages": CHAT, "n": 2}, 400, "n"),
    ("logprobs", {"messages": CHAT, "logprobs": True}, 400, "logprobs"),
    ("tools", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("penalty", {"messages": CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("no messages", {"messages": []}, 400, "messages"),
    ("a bad role", {"messages": [{"role": "root", "content": "x"}]}, 400, None),
    ("an image part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, None),
    ("too many stop strings", {"messages": CHAT, "stop": ["a"] * 17}, 400, "stop"),
    ("stream_options without stream", {"messages": CHAT, "stream_options": {
        "include_usage": True}}, 400, "stream_options"),
    ("another model", {"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
    ("a prompt over the context", {"messages": [{"role": "user", "content": "hi " * 9000}],
     "max_tokens": 10}, 400, None),
]  # fmt: skip


def test_bad_bodies_get_openai_errors_and_the_gateway_goes_on(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        for name, body, status, param in BAD_BODIES:
            got_status, reply = await post(server, "/v1/chat/completions", body)
            assert got_status == status, (name, reply)
            error = reply["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert error["message"], name
            if param is not None:
                assert error["param"] == param, (name, error)
        status, reply = await post(server, "/v1/chat/completions", {"messages": CHAT, "x": 1})
        assert "x" in reply["error"]["message"]
        long_chat = [{"role": "user", "content": "hi " * 9000}]
        status, reply = await post(server, "/v1/chat/completions", {"messages": long_chat})
        assert reply["error"]["code"] == "context_length_exceeded"
        # A body over the limit (the websocket's frame limit) is refused unread.
        status, reply = await post(server, "/v1/completions", b"{" + b" " * (64 << 10) + b"}")
        assert status == 413 and reply["error"]["code"] == "request_too_large"
        # aiohttp's own refusals under /v1 have OpenAI's shape too.
        async with aiohttp.ClientSession() as session:
            for method, path, expected in (
                ("GET", "/v1/chat/completions", 405),
                ("POST", "/v1/nothing", 404),
            ):
                async with session.request(method, f"{server.http_url}{path}") as response:
                    assert response.status == expected
                    assert (await response.json())["error"]["message"]
        # Completions' own forms.
        for body in ({"prompt": [["a"]]}, {"prompt": [True, 2]}, {"prompt": ["a", "b"]}, {}):
            status, reply = await post(server, "/v1/completions", body)
            assert status == 400 and reply["error"]["param"] == "prompt", body
        # The official client raises the matching errors.
        client = client_of(server)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=CHAT, n=3)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=CHAT)
        await client.close()
        # Nothing of it reached the scheduler; a good request still does.
        assert await upstream.redis.xlen(KEYS.requests) == 0
        call = asyncio.create_task(post(server, "/v1/completions", {"prompt": "x"}))
        submit = await upstream.next_submit()
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "fine"))
        status, reply = await call
        assert status == 200 and reply["choices"][0]["text"] == "fine"
        assert submit.sampling.max_tokens == 16  # OpenAI's default for completions

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario, max_frame_bytes=64 << 10)


def test_refusals_before_the_first_token_are_statuses_after_it_stream_events(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        body = {"messages": CHAT, "stream": True, "max_tokens": 50}
        call = asyncio.create_task(post(server, "/v1/chat/completions", body))
        submit = await upstream.next_submit()
        await upstream.publish_raw(
            encode(RequestRejected(submit.request_id, "queue_full", "the queue is full"))
        )
        status, reply = await call
        assert status == 429 and reply["error"]["code"] == "rate_limit_exceeded"

        async def read_stream() -> tuple[int, str, str]:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{server.http_url}/v1/chat/completions", json=body) as response,
            ):
                return response.status, response.headers["Content-Type"], await response.text()

        call_stream = asyncio.create_task(read_stream())
        submit = await upstream.next_submit()
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "a b c", None))
        await upstream.publish_raw(
            encode(RequestRejected(submit.request_id, "internal", "the worker failed"))
        )
        status, content_type, text = await call_stream
        assert status == 200 and content_type.startswith("text/event-stream")
        events = text.split("\n\n")
        data = [event.removeprefix("data: ") for event in events if event]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["type"] == "server_error" and "worker failed" in error["message"]
        text = "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in data[:-2])
        assert text == "a b c"

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_a_client_that_goes_away_cancels_its_request_at_once(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        for stream in (True, False):
            body = {"messages": CHAT, "stream": stream, "max_tokens": 500}
            reader, writer = await send_post(server, "/v1/chat/completions", body)
            submit = await upstream.next_submit()
            if stream:
                await upstream.publish(
                    *worker_tokens(chat_tokenizer, submit.request_id, "x y", None)
                )
                assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            writer.close()
            loop = asyncio.get_running_loop()
            started_s = loop.time()
            cancel = await upstream.next_cancel()
            assert cancel.request_id == submit.request_id
            assert loop.time() - started_s < 2.0
        assert server.session.num_live_requests == 0
        # Both count as aborted, though no frame said so (the cancel may reach
        # the scheduler a moment before the count is taken: look again briefly).
        key = ("orcapod_request_success_total", (("finished_reason", "abort"),))
        deadline = loop.time() + 2.0
        while (await scrape(server)).get(key) != 2 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert (await scrape(server)).get(key) == 2

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_an_sse_client_that_does_not_read_is_cut_off_at_the_outbox_cap(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        body = {"prompt": "x", "stream": True, "max_tokens": 1000}
        _, writer = await send_post(server, "/v1/completions", body, receive_buffer_bytes=4096)
        writer.transport.pause_reading()  # type: ignore[attr-defined]
        submit = await upstream.next_submit()
        text = " ".join(f"word{i}" for i in range(450))
        tokens = worker_tokens(chat_tokenizer, submit.request_id, text, None)
        for start in range(0, len(tokens), 200):
            await upstream.publish(*tokens[start : start + 200])
        # Over the cap the gateway drops the connection and cancels the request.
        assert (await upstream.next_cancel()).request_id == submit.request_id
        writer.close()
        # Others are served meanwhile and after.
        async with connect(server.url) as socket:
            request_id = await accept(socket, "other")
            await upstream.publish(*worker_tokens(chat_tokenizer, request_id, "fine"))
            await receive_until_done(socket)

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, max_outbox_bytes=16 << 10
    )


def test_keys_and_origins_as_on_the_websocket(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tmp_path: Path,
) -> None:
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text(tenant_toml(Tenant(name="alice"), [hash_key("opk_alice")]))

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        for headers in ({}, {"Authorization": "Bearer opk_wrong"}, {"Authorization": "Basic x"}):
            status, reply = await post(server, "/v1/completions", {"prompt": "x"}, headers)
            assert status == 401 and reply["error"]["code"] == "invalid_api_key", headers
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.http_url}/v1/models") as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
            async with session.get(f"{server.http_url}/health") as response:
                assert response.status == 503  # no key needed; no worker is ready
        status, reply = await post(
            server,
            "/v1/completions",
            {"prompt": "x"},
            {"Authorization": "Bearer opk_alice", "Origin": "http://evil.example"},
        )
        assert status == 403 and reply["error"]["type"] == "permission_error"
        with pytest.raises(openai.AuthenticationError):
            await client_of(server, "opk_nope").models.list()
        # One model as the list: a key first, even for an id that does not exist.
        for model_id in (MODEL, "nope"):
            with pytest.raises(openai.AuthenticationError):
                await client_of(server, "opk_nope").models.retrieve(model_id)
        client = client_of(server, "opk_alice")
        assert (await client.models.retrieve(MODEL)).id == MODEL
        call = asyncio.create_task(client.completions.create(model=MODEL, prompt="x"))
        submit = await upstream.next_submit()
        assert submit.tenant == "alice"
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "hi"))
        assert (await call).choices[0].text == "hi"
        await client.close()
        assert error_counts(await scrape(server)) == {"invalid_api_key": 7, "forbidden": 1}

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file
    )


async def stream_events(server: GatewayServer, body: Any, headers: dict[str, str]) -> list[str]:
    """A streamed request's events (their ``data``), read to the end of the response."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{server.http_url}/v1/chat/completions", json=body, headers=headers
        ) as response,
    ):
        assert response.status == 200
        text = await response.text()
    return [event.removeprefix("data: ") for event in text.split("\n\n") if event]


def assert_ends_with_error(events: list[str], error_type: str) -> dict[str, Any]:
    """The stream's last events are an error of ``error_type``, then ``[DONE]``."""
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == error_type, error
    return error


def test_a_revoked_keys_http_stream_ends_with_an_error_event(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tmp_path: Path,
) -> None:
    tenants_file = tmp_path / "tenants.toml"
    kept = tenant_toml(Tenant(name="bob"), [hash_key("opk_bob")])
    tenants_file.write_text(tenant_toml(Tenant(name="alice"), [hash_key("opk_alice")]) + kept)

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        body = {"messages": CHAT, "stream": True, "max_tokens": 500}
        call = asyncio.create_task(
            stream_events(server, body, {"Authorization": "Bearer opk_alice"})
        )
        submit = await upstream.next_submit()
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "a b", None))
        tenants_file.write_text(kept)
        events = await asyncio.wait_for(call, TIMEOUT_S)
        error = assert_ends_with_error(events, "authentication_error")
        assert error["message"] == "API key revoked"
        assert (await upstream.next_cancel()).request_id == submit.request_id
        assert error_counts(await scrape(server)) == {"invalid_api_key": 1}

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        tenants_file=tenants_file,
        tenants_reload_s=0.1,
    )


def test_an_http_stream_still_running_at_shutdown_ends_with_an_error_event(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def main() -> None:
        body = {"messages": CHAT, "stream": True, "max_tokens": 500}
        async with running_gateway(
            redis_server, chat_tokenizer, model_limits, drain_timeout_s=0.2
        ) as (server, upstream):
            call = asyncio.create_task(stream_events(server, body, {}))
            submit = await upstream.next_submit()
            await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "a", None))
            await asyncio.sleep(0.1)
        events = await asyncio.wait_for(call, TIMEOUT_S)
        error = assert_ends_with_error(events, "server_error")
        assert error["code"] == "service_unavailable"
        # Counted (the gateway is gone: read from its registry).
        samples = samples_of(generate_latest(server.metrics.registry).decode())
        assert error_counts(samples) == {"service_unavailable": 1}

    asyncio.run(main())


def test_a_new_request_while_draining_is_a_503(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    """On a connection opened before the drain: refused by the admission's
    one decision, answered as HTTP says a draining server is."""

    async def refused_then_finish(
        client: aiohttp.ClientSession, server: GatewayServer, upstream: FakeUpstream, running: str
    ) -> tuple[int, Any]:
        while not server.draining:
            await asyncio.sleep(0.01)
        async with client.post(
            f"{server.http_url}/v1/chat/completions", json={"messages": CHAT}
        ) as response:
            refused = response.status, await response.json()
        # The request in flight ends: the drain is over.
        await upstream.publish(*worker_tokens(chat_tokenizer, running, "a b"))
        return refused

    async def main() -> None:
        body = {"messages": CHAT, "stream": True, "max_tokens": 500}
        async with aiohttp.ClientSession() as client:
            async with running_gateway(
                redis_server, chat_tokenizer, model_limits, drain_timeout_s=10
            ) as (server, upstream):
                # A connection kept alive across the start of the drain.
                async with client.get(f"{server.http_url}/v1/models") as response:
                    assert response.status == 200
                    await response.read()
                call = asyncio.create_task(stream_events(server, body, {}))
                submit = await upstream.next_submit()
                refusal = asyncio.create_task(
                    refused_then_finish(client, server, upstream, submit.request_id)
                )
            status, reply = await asyncio.wait_for(refusal, TIMEOUT_S)
        assert status == 503, reply
        assert reply["error"] == json.loads(shutting_down().body())["error"]
        events = await asyncio.wait_for(call, TIMEOUT_S)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"]

    asyncio.run(main())


def test_a_body_not_declared_json_is_a_415(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    """A page of any site may send text/plain or a form without a preflight."""

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        body = json.dumps({"messages": CHAT}).encode()
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {} if content_type is None else {"Content-Type": content_type}
            async with (
                aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as session,
                session.post(
                    f"{server.http_url}/v1/chat/completions", data=body, headers=headers
                ) as response,
            ):
                assert response.status == 415, content_type
                error = (await response.json())["error"]
                assert error["code"] == "unsupported_media_type"
        assert await upstream.redis.xlen(KEYS.requests) == 0
        # With a charset it is JSON all the same.
        charset = {"Content-Type": "application/json; charset=utf-8"}
        call = asyncio.create_task(post(server, "/v1/chat/completions", body, charset))
        submit = await upstream.next_submit()
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "ok"))
        status, reply = await call
        assert status == 200 and reply["choices"][0]["message"]["content"] == "ok"

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_metrics_count_what_clients_were_sent(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            request_id = await accept(socket, "a")
            await upstream.publish(*worker_tokens(chat_tokenizer, request_id, "one two three"))
            await receive_until_done(socket)
            await post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
            samples = await scrape(server)
            assert samples[("orcapod_open_sockets", ())] == 1
        assert samples[("orcapod_request_success_total", (("finished_reason", "length"),))] == 1
        assert samples[("orcapod_request_errors_total", (("code", "invalid_request"),))] == 1
        assert samples[("orcapod_time_to_first_token_seconds_count", ())] == 1
        assert samples[("orcapod_e2e_request_latency_seconds_count", ())] == 1
        assert samples[("orcapod_inter_token_latency_seconds_count", ())] == 2
        assert samples[("orcapod_generation_tokens_total", ())] == 3
        assert samples[("orcapod_http_requests_in_flight", ())] == 0
        assert (await scrape(server))[("orcapod_open_sockets", ())] == 0

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_every_refusal_of_the_openai_api_is_counted_under_its_code(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        client = client_of(server)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=CHAT)
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-4o")
        options: Any = {"include_usage": True, "continuous_usage_stats": "yes"}
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(
                model=MODEL, prompt="x", stream=True, stream_options=options
            )
        assert (await post(server, "/v1/chat/completions", b'{"messages": ['))[0] == 400
        assert (await post(server, "/v1/completions", b"{" + b" " * (64 << 10) + b"}"))[0] == 413
        async with aiohttp.ClientSession() as session:
            for method, path, headers, expected in (
                ("POST", "/v1/completions", {"Content-Type": "text/plain"}, 415),
                ("POST", "/v1/nothing", {}, 404),
                ("GET", "/v1/chat/completions", {}, 405),
            ):
                url = f"{server.http_url}{path}"
                async with session.request(method, url, data=b"{}", headers=headers) as response:
                    assert response.status == expected
        # Refused by the core (its `error` frame): counted once, under the frame's code.
        status, _ = await post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
        assert status == 400
        # Served: no error.
        call = asyncio.create_task(client.completions.create(model=MODEL, prompt="x"))
        submit = await upstream.next_submit()
        await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "ok"))
        assert (await call).choices[0].text == "ok"
        await client.close()
        assert error_counts(await scrape(server)) == {
            "invalid_request": 4,
            "model_not_found": 2,
            "request_too_large": 1,
            "unsupported_media_type": 1,
            "not_found": 1,
            "method_not_allowed": 1,
        }

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario, max_frame_bytes=64 << 10)


async def scrape(server: GatewayServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The gateway's /metrics, by name and labels (less ``gateway`` and ``model_name``)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{server.http_url}/metrics") as response,
    ):
        assert response.status == 200
        return samples_of(await response.text())


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text, by name and labels (less ``gateway`` and ``model_name``)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.pop("gateway", GATEWAY_ID) == GATEWAY_ID
            assert sample.labels.pop("model_name", MODEL) == MODEL
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def error_counts(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """``orcapod_request_errors_total`` by ``code``."""
    return {
        dict(labels)["code"]: value
        for (name, labels), value in samples.items()
        if name == "orcapod_request_errors_total"
    }
