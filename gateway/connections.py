"""The gateway's open connections and where the core's frames for each go: a
websocket's outbox (:class:`SocketSink`), an OpenAI request's exchange
(:class:`ExchangeSink`); the dashboard sockets, with the key each presented.
And what a shutdown or a revoked key does to them all at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Protocol

from aiohttp import WSCloseCode, web

from gateway.actions import SendFrame
from gateway.openai_errors import OpenAIError, unauthorized
from gateway.openai_exchange import Exchange
from gateway.outbox import Outbox
from shared.protocol import Accepted, encode_json

# How long a closing socket waits for the client's close frame.
CLOSE_TIMEOUT_S = 5.0
REVOKED_REASON = "API key revoked"
GOING_AWAY_REASON = "gateway is shutting down"


class FrameSink(Protocol):
    """Where the core's frames for one socket go."""

    @property
    def outbox(self) -> Outbox: ...

    def put(self, action: SendFrame) -> bool:
        """Queue the action's frame; False once the outbox is over its cap."""
        ...


class SocketSink:
    """A websocket's frames: their JSON text, in its outbox."""

    def __init__(self, socket: web.WebSocketResponse, outbox: Outbox) -> None:
        self.socket = socket
        self.outbox = outbox

    def put(self, action: SendFrame) -> bool:
        return self.outbox.put(encode_json(action.frame).encode())


class ExchangeSink:
    """An OpenAI request's frames, into its exchange; its ``accepted`` with
    the prompt's length as tokenized (``num_prompt_tokens_of``: the session's)."""

    def __init__(self, exchange: Exchange, num_prompt_tokens_of: Callable[[str], int]) -> None:
        self.exchange = exchange
        self._num_prompt_tokens_of = num_prompt_tokens_of

    @property
    def outbox(self) -> Outbox:
        return self.exchange.outbox

    def put(self, action: SendFrame) -> bool:
        frame = action.frame
        if isinstance(frame, Accepted):
            num_prompt_tokens = self._num_prompt_tokens_of(frame.request_id)
            self.exchange.accept(frame.request_id, num_prompt_tokens)
            return True
        return self.exchange.put(action)


class Connections:
    """Every open connection of one gateway, by the session's socket id (a
    websocket, or an OpenAI request's virtual socket), and the dashboards."""

    def __init__(self) -> None:
        self._sinks: dict[int, FrameSink] = {}
        # Open dashboard sockets, with the hash of the key each presented.
        self._dashboards: dict[web.WebSocketResponse, str | None] = {}

    def sink(self, socket_id: int) -> FrameSink | None:
        """Where ``socket_id``'s frames go; None once it closed."""
        return self._sinks.get(socket_id)

    def add(self, socket_id: int, sink: FrameSink) -> None:
        self._sinks[socket_id] = sink

    def remove(self, socket_id: int) -> None:
        del self._sinks[socket_id]

    @contextmanager
    def dashboard(self, socket: web.WebSocketResponse, key_hash: str | None) -> Iterator[None]:
        """A dashboard socket, known while the block runs."""
        self._dashboards[socket] = key_hash
        try:
            yield
        finally:
            del self._dashboards[socket]

    @property
    def has_unsent_frames(self) -> bool:
        """Frames not yet handed to their connection."""
        return any(not sink.outbox.is_empty for sink in self._sinks.values())

    def end_exchanges(
        self, error: Callable[[], OpenAIError], which: Callable[[int], bool] = lambda _: True
    ) -> None:
        """End each HTTP response whose virtual socket is ``which`` with
        ``error()``; its handler then cancels what still runs."""
        for socket_id, sink in self._sinks.items():
            if isinstance(sink, ExchangeSink) and which(socket_id):
                sink.exchange.end_with(error())

    async def close_all(self) -> None:
        """Close every websocket and dashboard socket ("going away")."""
        sockets = [sink.socket for sink in self._sinks.values() if isinstance(sink, SocketSink)]
        async with asyncio.TaskGroup() as closing:
            for socket in [*sockets, *self._dashboards]:
                closing.create_task(
                    socket.close(code=WSCloseCode.GOING_AWAY, message=GOING_AWAY_REASON.encode())
                )

    async def close_revoked(self, revoked: Collection[int], valid: Collection[str]) -> None:
        """End the connections of keys that are gone: the sockets ``revoked``
        (HTTP responses with a 401 or an error event, websockets with 1008),
        and the dashboards whose key is not ``valid``."""
        revoked_ids = set(revoked)
        self.end_exchanges(lambda: unauthorized(REVOKED_REASON), revoked_ids.__contains__)
        dashboards = [
            socket
            for socket, key_hash in self._dashboards.items()
            if key_hash is not None and key_hash not in valid
        ]
        sockets = [
            sink.socket
            for socket_id, sink in self._sinks.items()
            if socket_id in revoked_ids and isinstance(sink, SocketSink)
        ]
        async with asyncio.TaskGroup() as closing:
            for socket in [*dashboards, *sockets]:
                closing.create_task(
                    close_socket(socket, WSCloseCode.POLICY_VIOLATION, REVOKED_REASON)
                )


async def close_socket(socket: web.WebSocketResponse, code: int, reason: str) -> None:
    """Close with ``code``; a peer that reads nothing cannot hold the close up."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await socket.close(code=code, message=reason.encode())
    except (TimeoutError, ConnectionError):
        pass
