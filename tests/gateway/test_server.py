"""The gateway actor end to end: real redis-server, real websockets on loopback, real tokenizer.

The test plays the scheduler and the worker: it reads SubmitRequest from the
requests stream and publishes TokenBatch to the gateway's channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as redis
from websockets.asyncio.client import ClientConnection, connect

from gateway.server import GatewayServer
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import (
    CancelRequest,
    RequestRejected,
    SampledToken,
    SubmitRequest,
    TokenBatch,
    decode_control_message,
    encode,
)
from shared.protocol import Accepted, Done, Error, Token, decode_server_message
from shared.settings import GatewaySettings, RedisSettings, model_location
from tests.conftest import RedisServer
from tests.gateway.worker_tokens import worker_tokens

GATEWAY_ID = "gw-test"
KEYS = RedisKeys("test")
TIMEOUT_S = 5.0


class FakeUpstream:
    """The scheduler and worker as the gateway sees them: two streams and a channel."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._last_ids = {KEYS.requests: "0-0", KEYS.control: "0-0"}

    async def _next(self, stream: str) -> Any:
        reply: Any = await self.redis.xread({stream: self._last_ids[stream]}, count=1, block=5000)
        assert reply, f"nothing on {stream}"
        [(_, [(entry_id, fields)])] = reply
        self._last_ids[stream] = entry_id
        return decode_control_message(fields[MESSAGE_FIELD.encode()])

    async def next_submit(self) -> SubmitRequest:
        message = await self._next(KEYS.requests)
        assert isinstance(message, SubmitRequest)
        return message

    async def next_cancel(self) -> CancelRequest:
        message = await self._next(KEYS.control)
        assert isinstance(message, CancelRequest)
        return message

    async def next_control(self) -> Any:
        return await self._next(KEYS.control)

    async def num_cancels(self) -> int:
        return int(await self.redis.xlen(KEYS.control))

    async def publish(self, *tokens: SampledToken) -> None:
        await self.publish_raw(encode(TokenBatch(worker_id="w0", tokens=list(tokens))))

    async def publish_raw(self, data: bytes) -> None:
        assert await self.redis.publish(KEYS.tokens(GATEWAY_ID), data) == 1


async def send(socket: ClientConnection, **frame: Any) -> None:
    await socket.send(json.dumps(frame))


async def receive(socket: ClientConnection) -> Any:
    return decode_server_message(await asyncio.wait_for(socket.recv(), TIMEOUT_S))


async def receive_until_done(socket: ClientConnection) -> tuple[list[Token], Done]:
    tokens: list[Token] = []
    while True:
        frame = await receive(socket)
        if isinstance(frame, Done):
            return tokens, frame
        assert isinstance(frame, Token), frame
        tokens.append(frame)


async def accept(socket: ClientConnection, client_id: str, **fields: Any) -> str:
    await send(socket, type="generate", id=client_id, **{"prompt": "Hi", **fields})
    frame = await receive(socket)
    assert isinstance(frame, Accepted), frame
    return frame.request_id


@contextlib.asynccontextmanager
async def running_gateway(
    redis_server: RedisServer,
    tokenizer: ChatTokenizer,
    limits: ModelLimits,
    **overrides: Any,
) -> AsyncIterator[tuple[GatewayServer, FakeUpstream]]:
    settings = GatewaySettings(
        redis=RedisSettings(url=redis_server.url, prefix=KEYS.prefix),
        model=model_location(),
        gateway_id=GATEWAY_ID,
        port=0,
        heartbeat_s=0.2,
        max_tokens_limit=limits.max_tokens_limit,
        **{"detach_grace_s": 0.0, **overrides},
    )
    server = GatewayServer(settings, tokenizer, limits)
    stop = asyncio.Event()
    client = redis.Redis.from_url(redis_server.url)
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(server.run(stop))
            await asyncio.wait_for(server.listening.wait(), TIMEOUT_S)
            try:
                yield server, FakeUpstream(client)
            finally:
                stop.set()
    finally:
        await client.aclose()


def run_with_gateway(
    redis_server: RedisServer,
    tokenizer: ChatTokenizer,
    limits: ModelLimits,
    scenario: Callable[[GatewayServer, FakeUpstream], Awaitable[None]],
    **overrides: Any,
) -> None:
    async def main() -> None:
        async with running_gateway(redis_server, tokenizer, limits, **overrides) as (
            server,
            upstream,
        ):
            await asyncio.wait_for(scenario(server, upstream), 20)

    asyncio.run(main())


async def http_status(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    status_line = await asyncio.wait_for(reader.readline(), TIMEOUT_S)
    writer.close()
    await writer.wait_closed()
    return int(status_line.split()[1])


def test_healthz_follows_the_ready_key_and_redis(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert server.port is not None
        assert await http_status(server.port, "/healthz") == 503
        await upstream.redis.set(KEYS.ready, "1", px=5000)
        assert await http_status(server.port, "/healthz") == 200
        assert await http_status(server.port, "/elsewhere") == 404
        assert await upstream.redis.exists(KEYS.gateway_heartbeat(GATEWAY_ID))
        redis_server.process.terminate()
        redis_server.process.wait()
        assert await http_status(server.port, "/healthz") == 503

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_chat_request_streams_tokens_then_done(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    messages = [{"role": "user", "content": "Say hi"}]

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            request_id = await accept(
                socket, "c1", prompt=None, messages=messages, max_tokens=20, temperature=0.5
            )
            submit = await upstream.next_submit()
            assert submit.request_id == request_id and submit.gateway_id == GATEWAY_ID
            prompt = chat_tokenizer.apply_chat_template(messages)
            assert submit.prompt_ids == chat_tokenizer.encode(prompt, add_special_tokens=False)
            assert submit.sampling.max_tokens == 20 and submit.sampling.temperature == 0.5
            # A multi-byte character over several tokens, then the model's end of turn.
            text = "🦩 flamingo 世界"
            tokens = worker_tokens(chat_tokenizer, request_id, text, finish=None)
            eos = SampledToken(request_id, chat_tokenizer.eos_token_id or 0, len(tokens), "stop")
            # Out of order and duplicated: each seq reaches the client once, in order.
            await upstream.publish(tokens[1], tokens[0])
            await upstream.publish(tokens[1], *tokens[2:])
            await upstream.publish(eos, tokens[3])
            frames, done = await receive_until_done(socket)
            assert [frame.seq for frame in frames] == list(range(len(tokens) + 1))
            assert all(frame.id == "c1" and "\ufffd" not in frame.text for frame in frames)
            assert "".join(frame.text for frame in frames) == text
            assert frames[-1].text == ""  # the end-of-turn token itself has no text
            assert done.finish_reason == "stop" and done.id == "c1"
            assert done.usage.prompt_tokens == len(submit.prompt_ids)
            assert done.usage.completion_tokens == len(tokens) + 1
            assert done.timings.ttft_ms is not None
            assert 0 <= done.timings.ttft_ms <= done.timings.total_ms

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_each_validation_error_leaves_the_socket_usable(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    bad_frames: list[tuple[str | bytes, str]] = [
        (b"\x00binary", "invalid_request"),
        ("not json", "invalid_request"),
        ('{"type":"shout","id":"x"}', "invalid_request"),
        ('{"type":"generate","id":"x","prompt":"a","temperature":"hot"}', "invalid_request"),
        ('{"type":"generate","id":"x","prompt":"a","top_k":-1}', "invalid_request"),
        ('{"type":"generate","id":"x","prompt":"a","max_tokens":5000}', "invalid_request"),
        ('{"type":"generate","id":"x","prompt_token_ids":[99999]}', "invalid_request"),
        ('{"type":"generate","id":"x","prompt_token_ids":[]}', "invalid_request"),
        ('{"type":"generate","id":"x","prompt":"a","messages":[]}', "invalid_request"),
        (
            '{"type":"generate","id":"x","max_tokens":900,"prompt_token_ids":['
            + ",".join(["1"] * 7500)
            + "]}",
            "prompt_too_long",
        ),
        ('{"type":"cancel","id":"nobody"}', "invalid_request"),
        ('{"type":"resume","request_id":"nothing"}', "invalid_request"),
        ('{"type":"generate","id":"a","prompt":"again"}', "invalid_request"),  # duplicate id
    ]

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            # One of the socket's two places taken: the bad frames are judged on
            # their own (a full socket answers queue_full before tokenizing).
            await accept(socket, "a")
            for frame, code in bad_frames:
                await socket.send(frame)
                error = await receive(socket)
                assert isinstance(error, Error), (frame[:80], error)
                assert error.code == code, (frame[:80], error)
            await accept(socket, "b")
            await send(socket, type="generate", id="c", prompt="one too many")
            error = await receive(socket)
            assert isinstance(error, Error) and (error.code, error.id) == ("queue_full", "c")
            await send(socket, type="cancel", id="a")
            _, done = await receive_until_done(socket)
            assert done.finish_reason == "cancelled"
            request_id = await accept(socket, "c")
            await upstream.publish(*worker_tokens(chat_tokenizer, request_id, "ok"))
            frames, done = await receive_until_done(socket)
            assert "".join(frame.text for frame in frames) == "ok" and done.id == "c"

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        max_frame_bytes=65_536,
        max_requests_per_socket=2,
    )


def test_cancel_stop_strings_and_closed_sockets_cancel_upstream(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            # Cancel: done with usage so far, a CancelRequest, nothing after.
            cancelled = await accept(socket, "c")
            tokens = worker_tokens(chat_tokenizer, cancelled, "one two three")
            await upstream.publish(*tokens[:2])
            assert [(await receive(socket)).seq for _ in range(2)] == [0, 1]
            await send(socket, type="cancel", id="c")
            done = await receive(socket)
            assert isinstance(done, Done) and done.finish_reason == "cancelled"
            assert done.usage.completion_tokens == 2
            assert (await upstream.next_cancel()).request_id == cancelled
            await upstream.publish(*tokens[2:])
            # Stop string: the text stops right before it, then done stop and a cancel.
            stopped = await accept(socket, "s", stop=["\n\n", "END"])
            await upstream.publish(
                *worker_tokens(chat_tokenizer, stopped, "Sure: yes END no", None)
            )
            frames, done = await receive_until_done(socket)
            assert "".join(frame.text for frame in frames) == "Sure: yes "
            assert done.finish_reason == "stop" and done.id == "s"
            assert (await upstream.next_cancel()).request_id == stopped
            # A closed socket cancels every request still in flight on it.
            live = {await accept(socket, "x"), await accept(socket, "y")}
        assert {(await upstream.next_cancel()).request_id for _ in range(2)} == live

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_resume_on_a_new_socket_replays_without_loss_or_duplicates(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        text = "one two three four five six"
        async with connect(server.url) as first:
            request_id = await accept(first, "a")
            tokens = worker_tokens(chat_tokenizer, request_id, text)
            await upstream.publish(*tokens[:3])
            seen = [await receive(first) for _ in range(2)]  # seq 2 is "lost" with the socket
            async with connect(server.url) as second:
                await send(second, type="resume", request_id=request_id, after_seq=1, id="b")
                await upstream.publish(*tokens[3:])
                frames, done = await receive_until_done(second)
                assert [frame.seq for frame in frames] == list(range(2, len(tokens)))
                assert all(frame.id == "b" for frame in frames) and done.id == "b"
                assert "".join(frame.text for frame in seen + frames) == text
                await assert_silent_after(first, seq=2)
            # Resume of a finished request replays its end again, under the original id.
            async with connect(server.url) as third:
                await send(third, type="resume", request_id=request_id, after_seq=len(tokens) - 2)
                replay, done = await receive_until_done(third)
                assert [frame.seq for frame in replay] == [len(tokens) - 1]
                assert done.id == "a" and done.finish_reason == "length"
        # The request had moved away: closing its first socket cancelled nothing.
        assert await upstream.num_cancels() == 0

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


async def assert_silent_after(socket: ClientConnection, seq: int) -> None:
    """The old socket may still hold frames sent before the resume, never later ones."""
    while True:
        try:
            frame = decode_server_message(await asyncio.wait_for(socket.recv(), 0.3))
        except TimeoutError:
            return
        assert isinstance(frame, Token) and frame.seq <= seq, frame


def test_undecodable_and_rejected_messages_do_not_stop_the_gateway(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            await upstream.publish_raw(b"\x93garbage")
            for _ in range(50):
                if await upstream.redis.xlen(KEYS.dead):
                    break
                await asyncio.sleep(0.05)
            entries: Any = await upstream.redis.xrange(KEYS.dead)
            [(_, fields)] = entries
            assert fields[b"source"] == KEYS.tokens(GATEWAY_ID).encode()
            assert fields[b"data"] == b"\x93garbage" and fields[b"error"]
            refused = await accept(socket, "r")
            rejected = RequestRejected(request_id=refused, code="prompt_too_long", message="big")
            await upstream.publish_raw(encode(rejected))
            assert await receive(socket) == Error(code="prompt_too_long", message="big", id="r")
            request_id = await accept(socket, "r")
            await upstream.publish(*worker_tokens(chat_tokenizer, request_id, "still here"))
            frames, done = await receive_until_done(socket)
            assert "".join(frame.text for frame in frames) == "still here"
            assert done.finish_reason == "length"

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_shutdown_closes_sockets_and_cancels_their_requests(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def main() -> None:
        # Leaving the context stops the gateway and waits until it has stopped; the
        # request still in flight when the drain timeout ends is cancelled.
        async with running_gateway(
            redis_server, chat_tokenizer, model_limits, drain_timeout_s=0.2
        ) as (server, _):
            socket = await connect(server.url)
            request_id = await accept(socket, "a")
        await asyncio.wait_for(socket.wait_closed(), TIMEOUT_S)
        assert socket.close_code == 1001  # going away
        client = redis.Redis.from_url(redis_server.url)
        try:
            entries: Any = await client.xrange(KEYS.control)
            [(_, fields)] = entries
            cancel = decode_control_message(fields[MESSAGE_FIELD.encode()])
            assert cancel == CancelRequest(request_id=request_id)
            assert not await client.exists(KEYS.gateway_heartbeat(GATEWAY_ID))
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_burst_of_a_thousand_requests_is_queued_not_refused(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    """1,000 generate frames at once (250 sockets x 4) are all accepted and all
    reach the requests stream: more XADDs in flight than the Redis pool has
    connections wait for one instead of failing."""

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        url = f"ws://127.0.0.1:{server.port}/ws"
        sockets = await asyncio.gather(*(connect(url) for _ in range(250)))
        try:
            frames = [
                json.dumps({"type": "generate", "id": f"q{i}", "prompt": "Hi", "max_tokens": 1})
                for i in range(4)
            ]
            await asyncio.gather(*(socket.send(frame) for socket in sockets for frame in frames))
            for socket in sockets:
                replies = [await receive(socket) for _ in frames]
                assert all(isinstance(reply, Accepted) for reply in replies), replies
            assert await upstream.redis.xlen(KEYS.requests) == 1000
        finally:
            for socket in sockets:
                await socket.close()

    # One tenant (the open one) holds them all: its cap is raised to fit the burst.
    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        max_requests_per_tenant=1000,
        max_tokenizing=1000,
    )


def test_a_request_without_progress_ends_in_an_error_and_is_cancelled_upstream(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    """Nobody ever answers one submit (a lost message, say): after the stall
    deadline its client gets an error and the scheduler a cancel, within a few
    ticks (0.2 s here); a request whose tokens keep coming is left be."""

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            accepted_at_s = time.monotonic()
            silent = await accept(socket, "silent")
            moving = await accept(socket, "moving")
            tokens = worker_tokens(chat_tokenizer, moving, " a b c d e f g h i j k l", None)

            async def keep_moving() -> None:
                for token in tokens[:8]:
                    await upstream.publish(token)
                    await asyncio.sleep(0.25)

            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(keep_moving())
                frame = await receive(socket)
                while isinstance(frame, Token):  # the moving request's tokens
                    frame = await receive(socket)
                waited_s = time.monotonic() - accepted_at_s
            assert frame == Error(
                code="internal", message="the request made no progress for 1 s", id="silent"
            )
            assert 1.0 <= waited_s < 3.0, waited_s
            assert (await upstream.next_cancel()).request_id == silent
            stream = server.session.stream(moving)
            assert stream is not None and not stream.finished

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, request_stall_timeout_s=1.0
    )
