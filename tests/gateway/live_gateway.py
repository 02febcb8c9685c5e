"""A real gateway that outlives hypothesis's examples, for the protocol fuzz tests.

Hypothesis runs examples one by one, synchronously, so the gateway lives on an
``asyncio.Runner``'s loop and each example is one ``run`` on it: the gateway's
tasks move while an example runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as redis
from websockets.asyncio.client import ClientConnection, connect

from gateway.server import GatewayServer
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.keys import MESSAGE_FIELD
from shared.messages import SubmitRequest, decode_control_message
from shared.protocol import Accepted
from shared.settings import GatewaySettings, RedisSettings, model_location
from tests.gateway.bad_frames import MAX_FRAME_BYTES
from tests.gateway.test_server import (
    GATEWAY_ID,
    KEYS,
    TIMEOUT_S,
    FakeUpstream,
    http_status,
    receive,
    send,
)

T = TypeVar("T")
SCENARIO_TIMEOUT_S = 20.0
MAX_REQUESTS_PER_SOCKET = 8


class LiveGateway:
    """A real gateway that outlives hypothesis's examples, on one event loop."""

    def __init__(
        self,
        runner: asyncio.Runner,
        redis_url: str,
        tokenizer: ChatTokenizer,
        limits: ModelLimits,
    ) -> None:
        self.tokenizer = tokenizer
        settings = GatewaySettings(
            redis=RedisSettings(url=redis_url, prefix=KEYS.prefix),
            model=model_location(),
            gateway_id=GATEWAY_ID,
            port=0,
            heartbeat_s=0.2,
            max_tokens_limit=limits.max_tokens_limit,
            max_frame_bytes=MAX_FRAME_BYTES,
            max_requests_per_socket=MAX_REQUESTS_PER_SOCKET,
            detach_grace_s=0.0,
        )
        self.server = GatewayServer(settings, tokenizer, limits)
        self._runner = runner
        self._redis_url = redis_url
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._upstream: FakeUpstream | None = None
        # Every request_id the gateway accepted, and how far the requests stream was read.
        self._accepted: set[str] = set()
        self._requests_read_id = "0-0"

    @property
    def upstream(self) -> FakeUpstream:
        assert self._upstream is not None
        return self._upstream

    def run(self, scenario: Callable[[], Awaitable[T]]) -> T:
        """Run one example's coroutine (and the gateway meanwhile) to its end."""

        async def bounded() -> T:
            return await asyncio.wait_for(scenario(), SCENARIO_TIMEOUT_S)

        return self._runner.run(bounded())

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.run(self._stop), name="gateway")
        await asyncio.wait_for(self.server.listening.wait(), TIMEOUT_S)
        self._upstream = FakeUpstream(redis.Redis.from_url(self._redis_url))
        await self.upstream.redis.set(KEYS.ready, "1")  # /healthz: 200 while Redis answers

    async def stop(self) -> None:
        self._stop.set()
        try:
            if self._task is not None:
                await self._task  # a crash of the gateway surfaces here
        finally:
            if self._upstream is not None:
                await self._upstream.redis.aclose()

    async def accept(self, socket: ClientConnection, client_id: str) -> str:
        """A valid generate on ``socket``, accepted at once; returns its request_id."""
        replies, request_id = await self.replies_then_accept(socket, client_id)
        assert not replies, replies
        return request_id

    async def replies_then_accept(
        self, socket: ClientConnection, client_id: str
    ) -> tuple[list[Any], str]:
        """Send a valid generate; return the frames that came before its `accepted`, and
        its request_id."""
        await send(socket, type="generate", id=client_id, prompt="Hi", max_tokens=64)
        replies: list[Any] = []
        while True:
            frame = await receive(socket)
            if isinstance(frame, Accepted):
                self._accepted.add(frame.request_id)
                if frame.id == client_id:
                    return replies, frame.request_id
            replies.append(frame)

    async def assert_only_accepted_requests_submitted(self, last_request_id: str) -> None:
        """What reached the requests stream since the last call is requests the gateway
        accepted, up to ``last_request_id`` (the XADD may follow `accepted` by a moment)."""
        submitted: list[str] = []
        while last_request_id not in submitted:
            reply: Any = await self.upstream.redis.xread(
                {KEYS.requests: self._requests_read_id}, block=int(TIMEOUT_S * 1000)
            )
            assert reply, f"{last_request_id} never reached {KEYS.requests}"
            for entry_id, fields in reply[0][1]:
                self._requests_read_id = entry_id.decode()
                submit = decode_control_message(fields[MESSAGE_FIELD.encode()])
                assert isinstance(submit, SubmitRequest)
                submitted.append(submit.request_id)
        assert set(submitted) <= self._accepted, set(submitted) - self._accepted

    async def assert_alive(self) -> None:
        """The gateway's task still runs, /healthz answers, a new socket handshakes."""
        assert self._task is not None and not self._task.done()
        assert self.server.port is not None
        assert await http_status(self.server.port, "/healthz") == 200
        async with connect(self.server.url) as socket:
            await asyncio.wait_for(await socket.ping(), TIMEOUT_S)

    async def assert_no_socket_left(self) -> None:
        """Every socket the examples closed is gone from the session too."""
        for _ in range(100):
            if self.server.session.num_sockets == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.server.session.num_sockets} sockets left open")
