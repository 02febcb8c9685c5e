"""What one client can make the gateway hold open, end to end on raw sockets:
a connection that sends nothing, a slowloris, a dripped or endless chunked
body, too many connections; and that a websocket and a keep-alive client are
left alone. Real redis-server, real gateway on loopback.

The timeouts differ (idle 1 s, headers 2 s, body 3 s) so each test shows which
clock closed its connection; the log line's ``reason`` says so too."""

from __future__ import annotations

import asyncio
from typing import Any

from structlog.testing import capture_logs
from websockets.asyncio.client import connect

from gateway.server import GatewayServer
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.protocol import Error
from tests.conftest import RedisServer
from tests.gateway.test_server import (
    KEYS,
    TIMEOUT_S,
    FakeUpstream,
    accept,
    receive,
    receive_until_done,
    run_with_gateway,
)
from tests.gateway.worker_tokens import worker_tokens

IDLE_TIMEOUT_S = 1.0
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 8
MAX_CONNECTIONS_PER_ADDRESS = 5
LIMITS: dict[str, Any] = {
    "idle_timeout_s": IDLE_TIMEOUT_S,
    "header_timeout_s": HEADER_TIMEOUT_S,
    "body_timeout_s": BODY_TIMEOUT_S,
    "max_connections": MAX_CONNECTIONS,
    "max_connections_per_address": MAX_CONNECTIONS_PER_ADDRESS,
}
# A loaded 2-core machine is late now and then; never early.
LATE_S = 1.5
DRIP_EVERY_S = 0.5
CHAT_PATH = "/v1/chat/completions"
CHUNKED_POST = (
    f"POST {CHAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    "Transfer-Encoding: chunked\r\n\r\n"
).encode()
# More than any request may send (max_frame_bytes, 1 MiB, and 1 MiB of overhead).
ENDLESS_BYTES = 32 << 20


Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_raw(server: GatewayServer, source: str = "127.0.0.1") -> Streams:
    assert server.port is not None
    return await asyncio.open_connection("127.0.0.1", server.port, local_addr=(source, 0))


async def seconds_until_closed(
    streams: Streams, since_s: float, drips: list[bytes] | None = None, limit_s: float = 10.0
) -> float:
    """Seconds from ``since_s`` until the gateway closes the connection, sending
    the next of ``drips`` every half second meanwhile; it must answer nothing."""
    reader, writer = streams
    loop = asyncio.get_running_loop()
    pending = iter(drips or [])
    while loop.time() - since_s < limit_s:
        try:
            data = await asyncio.wait_for(reader.read(65536), DRIP_EVERY_S)
        except TimeoutError:
            drip = next(pending, b"")
            try:
                writer.write(drip)
                await writer.drain()
            except ConnectionError:
                break
            continue
        except ConnectionError:
            break
        assert not data, f"the gateway answered {data[:200]!r}"
        break
    else:
        raise AssertionError(f"still open after {limit_s} s")
    elapsed_s = loop.time() - since_s
    writer.close()
    return elapsed_s


async def get(streams: Streams, path: str) -> tuple[int, bytes]:
    """One keep-alive GET on an open connection: its status and body."""
    streams[1].write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return await read_response(streams[0])


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    body = await reader.readexactly(int(headers["Content-Length"]))
    return int(lines[0].split()[1]), body


def closes(logs: list[dict[str, Any]]) -> list[str]:
    return [entry["reason"] for entry in logs if entry["event"] == "connections_closed"]


def run(
    redis_server: RedisServer,
    tokenizer: ChatTokenizer,
    limits: ModelLimits,
    scenario: Any,
    **overrides: Any,
) -> None:
    run_with_gateway(redis_server, tokenizer, limits, scenario, **{**LIMITS, **overrides})


def test_a_silent_connection_is_closed_after_the_idle_timeout(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        start_s = asyncio.get_running_loop().time()
        streams = await open_raw(server)
        elapsed_s = await seconds_until_closed(streams, start_s)
        assert IDLE_TIMEOUT_S <= elapsed_s < IDLE_TIMEOUT_S + LATE_S

    run(redis_server, chat_tokenizer, model_limits, scenario)


def test_a_slowloris_is_closed_after_the_header_timeout(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        streams = await open_raw(server)
        # Idle nearly its whole allowance, then a header line every half second.
        await asyncio.sleep(IDLE_TIMEOUT_S * 0.8)
        streams[1].write(b"GET /healthz HTTP/1.1\r\n")
        start_s = asyncio.get_running_loop().time()
        lines = [f"X-Slow-{i}: {i}\r\n".encode() for i in range(100)]
        with capture_logs() as logs:
            elapsed_s = await seconds_until_closed(streams, start_s, lines)
        assert HEADER_TIMEOUT_S <= elapsed_s < HEADER_TIMEOUT_S + LATE_S
        assert closes(logs) == ["header_timeout"]

    run(redis_server, chat_tokenizer, model_limits, scenario)


def test_a_dripped_chat_completions_body_is_closed_after_the_body_timeout(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 200 + b'"}]}'
        parts = [body[i : i + 7] for i in range(0, len(body), 7)]
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts)
        drips = [chunked[i : i + 3] for i in range(0, len(chunked), 3)]
        streams = await open_raw(server)
        streams[1].write(CHUNKED_POST)
        start_s = asyncio.get_running_loop().time()
        with capture_logs() as logs:
            elapsed_s = await seconds_until_closed(streams, start_s, drips)
        assert BODY_TIMEOUT_S <= elapsed_s < BODY_TIMEOUT_S + LATE_S
        assert closes(logs) == ["body_timeout"]
        # The handler that was reading the body is gone, and its virtual socket.
        for _ in range(50):
            if server.session.num_sockets == 0:
                break
            await asyncio.sleep(0.02)
        assert server.session.num_sockets == 0

    run(redis_server, chat_tokenizer, model_limits, scenario)


def test_a_chunk_size_line_that_never_ends_is_cut_at_the_byte_bound(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        reader, writer = await open_raw(server)
        writer.write(CHUNKED_POST + b"1;")  # a chunk extension, never ended
        loop = asyncio.get_running_loop()
        start_s = loop.time()
        num_sent = 0
        with capture_logs() as logs:
            try:
                while num_sent < ENDLESS_BYTES:
                    writer.write(b"a" * (64 << 10))
                    await asyncio.wait_for(writer.drain(), TIMEOUT_S)
                    num_sent += 64 << 10
            except ConnectionError:
                pass
            assert num_sent < ENDLESS_BYTES, "the gateway read the whole endless line"
            try:
                rest = await asyncio.wait_for(reader.read(), TIMEOUT_S)
            except ConnectionError:
                rest = b""
            assert rest == b"", rest  # cut, not answered
        # Cut by the byte bound, long before the body timeout.
        assert loop.time() - start_s < BODY_TIMEOUT_S
        assert closes(logs) == ["max_request_bytes"]
        writer.close()

    run(redis_server, chat_tokenizer, model_limits, scenario)


async def first_words(server: GatewayServer, source: str) -> bytes:
    """What the gateway says, unasked, to a new connection from ``source``."""
    reader, writer = await open_raw(server, source)
    try:
        return await asyncio.wait_for(reader.read(), TIMEOUT_S)
    finally:
        writer.close()


def test_connections_past_the_caps_are_refused_and_those_within_work(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    refused = b"HTTP/1.1 503 Service Unavailable\r\n"

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        await upstream.redis.set(KEYS.ready, "1")
        with capture_logs() as logs:
            mine = [await open_raw(server) for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
            answer = await first_words(server, "127.0.0.1")
            assert answer.startswith(refused), answer
            # Other addresses still get in, up to the cap on all connections.
            others = [await open_raw(server, "127.0.0.2") for _ in range(3)]
            answer = await first_words(server, "127.0.0.3")
            assert answer.startswith(refused), answer
        refusals = [entry["reason"] for entry in logs if entry["event"] == "connections_refused"]
        assert refusals == ["max_connections_per_address", "max_connections"]
        # Those let in are served, several requests each.
        for streams in [*mine, *others]:
            assert await get(streams, "/healthz") == (200, b"ready\n")
            assert await get(streams, "/healthz") == (200, b"ready\n")
        # A closed one makes room.
        mine[0][1].close()
        await mine[0][1].wait_closed()
        for _ in range(50):
            replacement = await open_raw(server)
            try:
                if await get(replacement, "/healthz") == (200, b"ready\n"):
                    break
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            replacement[1].close()
            await asyncio.sleep(0.02)  # the gateway had not yet seen the close
        else:
            raise AssertionError("a closed connection's place was never freed")
        for _, writer in [*mine[1:], *others, replacement]:
            writer.close()

    run(redis_server, chat_tokenizer, model_limits, scenario)


def test_a_websocket_outlives_every_timeout_and_still_works(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        # Uncompressed: the frames' bytes are what the connection carries.
        async with connect(server.url, ping_interval=None, compression=None) as socket:
            await asyncio.sleep(BODY_TIMEOUT_S + 1.0)
            await asyncio.wait_for(await socket.ping(), TIMEOUT_S)
            # More in all than any one HTTP request may send: each frame gets its error.
            junk = "x" * (900 << 10)
            for _ in range(3):
                await socket.send(junk)
                assert isinstance(await receive(socket), Error)
            request_id = await accept(socket, "c1", max_tokens=20)
            await upstream.next_submit()
            await asyncio.sleep(BODY_TIMEOUT_S + 1.0)  # a request that waits long
            await upstream.publish(*worker_tokens(chat_tokenizer, request_id, "still here"))
            tokens, done = await receive_until_done(socket)
            assert "".join(token.text for token in tokens) == "still here"
            assert (done.id, done.finish_reason) == ("c1", "length")

    run(redis_server, chat_tokenizer, model_limits, scenario)


def test_a_keep_alive_client_is_served_until_it_idles_too_long(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        await upstream.redis.set(KEYS.ready, "1")
        streams = await open_raw(server)
        # Longer in all than the idle timeout, never idle that long at once.
        for _ in range(4):
            assert await get(streams, "/healthz") == (200, b"ready\n")
            await asyncio.sleep(IDLE_TIMEOUT_S / 2)
        # Pipelined: two requests in one write, answered in order.
        streams[1].write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 2)
        assert await read_response(streams[0]) == (200, b"ready\n")
        assert await read_response(streams[0]) == (200, b"ready\n")
        since_s = asyncio.get_running_loop().time()
        elapsed_s = await seconds_until_closed(streams, since_s)
        assert IDLE_TIMEOUT_S <= elapsed_s + 0.05 < IDLE_TIMEOUT_S + LATE_S

    run(redis_server, chat_tokenizer, model_limits, scenario)
