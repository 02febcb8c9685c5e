"""What one client can make the gateway hold, end to end: a socket that does
not read is closed (1013) once its outbox is over the cap; a frame over the
limit, compressed or not, closes its socket (1009) before it is held; a
Redis that refuses writes (maxmemory) is `queue_full`, not Redis's text."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as redis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from gateway.server import GatewayServer
from gateway.tokenizer import ChatTokenizer
from gateway.upstream import OVERLOADED_MESSAGE
from gateway.validation import ModelLimits
from shared.protocol import Error
from tests.conftest import RedisServer
from tests.gateway.test_server import (
    TIMEOUT_S,
    FakeUpstream,
    accept,
    receive,
    receive_until_done,
    run_with_gateway,
    send,
)
from tests.gateway.worker_tokens import worker_tokens

TRY_AGAIN_LATER = 1013
MESSAGE_TOO_BIG = 1009
MAX_OUTBOX_BYTES = 64 << 10
MAX_FRAME_BYTES = 64 << 10


async def close_code(socket: ClientConnection, timeout_s: float = 20.0) -> int | None:
    """Read (and drop) whatever the gateway still sends; the code it closed with."""
    async with asyncio.timeout(timeout_s):
        try:
            while True:
                await socket.recv()
        except ConnectionClosed:
            pass
    return socket.close_code


def test_a_socket_that_does_not_read_is_closed_at_its_outbox_cap(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url, max_queue=1) as socket:
            request_id = await accept(socket, "a", max_tokens=200)
            text = " ".join(f"w{i}" for i in range(40))
            await upstream.publish(*worker_tokens(chat_tokenizer, request_id, text))
            await receive_until_done(socket)
            # Ask for the replay over and over without reading: the kernel's
            # buffers fill, then the gateway's outbox, then it gives up.
            socket.transport.pause_reading()
            resume = json.dumps({"type": "resume", "request_id": request_id})
            for _ in range(3000):
                await socket.send(resume)
            socket.transport.resume_reading()
            assert await close_code(socket) == TRY_AGAIN_LATER
        # The gateway forgot the socket and serves others.
        async with connect(server.url) as other:
            await accept(other, "b")
        assert server.session.num_sockets <= 1

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        max_outbox_bytes=MAX_OUTBOX_BYTES,
    )


def test_a_frame_over_the_limit_closes_its_socket_compressed_or_not(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url, compression=None) as socket:
            await socket.send("x" * (MAX_FRAME_BYTES + 1))
            assert await close_code(socket) == MESSAGE_TOO_BIG
        # 8 MiB of one letter deflates to a few KiB on the wire: the gateway
        # stops inflating at the frame limit.
        async with connect(server.url, compression="deflate") as socket:
            assert socket.response is not None
            assert "permessage-deflate" in socket.response.headers["Sec-WebSocket-Extensions"]
            await send(socket, type="generate", id="z", prompt="a" * (8 << 20))
            assert await close_code(socket) == MESSAGE_TOO_BIG
        async with connect(server.url) as socket:
            request_id = await accept(socket, "ok")
            await upstream.publish(*worker_tokens(chat_tokenizer, request_id, "fine"))
            _, done = await receive_until_done(socket)
            assert done.finish_reason == "length"

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        max_frame_bytes=MAX_FRAME_BYTES,
    )


def test_a_redis_out_of_memory_is_queue_full_without_its_text(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        admin = redis.Redis.from_url(redis_server.url)
        try:
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", "1")
            async with connect(server.url) as socket:
                await accept(socket, "a")
                error = await receive(socket)
                assert error == Error(code="queue_full", message=OVERLOADED_MESSAGE, id="a")
                await admin.config_set("maxmemory", "0")
                await accept(socket, "b")
                submit = await asyncio.wait_for(upstream.next_submit(), TIMEOUT_S)
                assert submit.request_id
        finally:
            await admin.config_set("maxmemory", "0")
            await admin.aclose()

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)
