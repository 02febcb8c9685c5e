"""The session's shell: what comes in goes to the core (a client's frame, a
message of the tokens channel, an OpenAI request's ``generate``, a tick, a
connection opened or closed), and the actions the core returns are carried
out in order (``gateway/actions.py``): frames to their connection, prompts
to the tokenizer threads, writes to Redis (``gateway/upstream.py``), logs
read or followed (``gateway/log_reader.py``), waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
import structlog

from gateway.actions import (
    Action,
    DeadLetter,
    FollowLog,
    LoadLog,
    PostUpstream,
    SendFrame,
    Tokenize,
    Wait,
)
from gateway.connections import Connections, ExchangeSink, FrameSink
from gateway.handshake import Admitted
from gateway.log_reader import LogReader
from gateway.metrics import GatewayMetrics
from gateway.openai_exchange import Exchange
from gateway.refusal import Refused
from gateway.session import GatewaySession
from gateway.tokenizer_pool import TokenizerPool
from gateway.upstream import UpstreamWriter
from shared.keys import RedisKeys
from shared.protocol import Error

logger = structlog.get_logger(__name__)

INTERNAL_MESSAGE = "internal error"


class Dispatcher:
    """Drives one gateway's :class:`GatewaySession` and carries out its actions."""

    def __init__(
        self,
        session: GatewaySession,
        connections: Connections,
        metrics: GatewayMetrics,
        pool: TokenizerPool,
        redis: aioredis.Redis,
        keys: RedisKeys,
        log_retention_s: int,
        tokens_channel: str,
    ) -> None:
        self._session = session
        self._connections = connections
        self._metrics = metrics
        self._pool = pool
        self._tokens_channel = tokens_channel
        self._upstream = UpstreamWriter(redis, keys, session, log_retention_s)
        self.logs = LogReader(redis, keys, session, self.apply)

    # --- connections -----------------------------------------------------------------

    @asynccontextmanager
    async def connection(
        self, admitted: Admitted, sink: FrameSink, *, resumable: bool = True
    ) -> AsyncIterator[int]:
        """A connection of ``admitted``'s tenant, its frames into ``sink``,
        open while the block runs (yields its socket id); closing it detaches
        its requests, or cancels them at once when not ``resumable``."""
        socket_id = self._session.connect(admitted.tenant, admitted.key_hash, resumable=resumable)
        self._connections.add(socket_id, sink)
        try:
            yield socket_id
        finally:
            self._connections.remove(socket_id)
            self._metrics.connection_closed(socket_id)
            await self.apply(self._session.disconnect(socket_id, resumable=resumable))

    @asynccontextmanager
    async def exchange(self, admitted: Admitted, exchange: Exchange) -> AsyncIterator[int]:
        """One OpenAI request as a virtual socket of the session (not
        resumable): its ``generate`` checked, admitted and answered as a
        frame's, its frames into ``exchange``, open while the block runs."""
        sink = ExchangeSink(exchange, self._num_prompt_tokens)
        async with self.connection(admitted, sink, resumable=False) as socket_id:
            await self.apply(self._session.on_generate(socket_id, exchange.parsed.generate))
            yield socket_id

    def _num_prompt_tokens(self, request_id: str) -> int:
        # The session adds a request's stream before it sends its `accepted`.
        stream = self._session.stream(request_id)
        assert stream is not None, request_id
        return stream.num_prompt_tokens

    # --- what comes in ---------------------------------------------------------------

    async def on_client_frame(self, socket_id: int, frame: str | bytes) -> None:
        """A frame a websocket client sent."""
        try:
            actions = self._session.on_frame(socket_id, frame)
        except Exception:
            # A bug must not take the socket (or the gateway) down with it.
            logger.exception("client_frame_failed")
            actions = [SendFrame(socket_id, Error(code="internal", message=INTERNAL_MESSAGE))]
        await self.apply(actions)

    async def on_gateway_message(self, data: bytes) -> None:
        """A message of this gateway's tokens channel."""
        channel = self._tokens_channel
        try:
            actions = self._session.on_gateway_message(data, channel)
        except Exception as error:
            # The reader serves every socket of this gateway: keep it alive.
            logger.exception("gateway_message_failed", channel=channel)
            actions = [DeadLetter(source=channel, error=repr(error), data=data)]
        await self.apply(actions)

    async def on_tick(self) -> None:
        """Requests left by a closed socket and not resumed in time, and
        requests that stalled, end now."""
        await self.apply(self._session.on_tick())

    # --- the core's actions ----------------------------------------------------------

    async def apply(self, actions: list[Action]) -> None:
        """Carry out the core's actions in order."""
        for action in actions:
            if isinstance(action, SendFrame):
                self._send(action)
            elif isinstance(action, Tokenize):
                # Awaited by the socket's own reader: its frames are answered in
                # the order sent, and one socket holds at most one pool slot.
                await self._tokenize(action)
            elif isinstance(action, PostUpstream):
                await self.apply(await self._upstream.post(action))
            elif isinstance(action, DeadLetter):
                await self._upstream.dead_letter(action)
            elif isinstance(action, LoadLog):
                await self.logs.load(action)
            elif isinstance(action, FollowLog):
                self.logs.follow(action)
            elif isinstance(action, Wait):
                # Awaited by the reader of the socket (or HTTP request) that
                # was refused: it reads nothing meanwhile.
                await asyncio.sleep(action.duration_s)

    def _send(self, action: SendFrame) -> None:
        sink = self._connections.sink(action.socket_id)
        if sink is None:  # the connection closed meanwhile
            return
        if sink.outbox.overflowed:
            return
        self._metrics.on_frame(action.socket_id, action.frame, time.monotonic())
        if not sink.put(action):
            # The outbox closes the connection (a socket with 1013); its
            # requests detach (or, for an HTTP request, end) as on any close.
            logger.warning("outbox_overflowed", socket_id=action.socket_id)

    async def _tokenize(self, action: Tokenize) -> None:
        """One tokenizer job on a pool thread; its result goes to the core."""
        try:
            validated = await self._pool.tokenize(
                action.generate,
                action.tenant.name,
                action.num_chars,
                action.tenant.weight,
                action.max_tokens_cap,
            )
        except Refused as refused:  # the queue is full, or the prompt is refused
            actions = self._session.on_tokenize_failed(action.request_id, refused, action.num_chars)
        except Exception:
            logger.exception("tokenizing_failed", request_id=action.request_id)
            actions = self._session.on_tokenize_failed(
                action.request_id, Refused("internal", INTERNAL_MESSAGE)
            )
        else:
            actions = self._session.on_tokenized(action.request_id, action.generate, validated)
        await self.apply(actions)
