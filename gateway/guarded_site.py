"""The aiohttp shell around ``gateway/connection_guard.py``: the site the
gateway listens with, the protocol each of its connections runs, and the
middleware that tells a connection when the application takes a request and
when it is done with it.

A connection over a cap is answered 503 and closed before aiohttp sees it; one
that misses a deadline or sends more than a request may is cut (aborted). A
websocket leaves the guard at its upgrade: its own pings keep it honest.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from typing import Any, cast

import structlog
from aiohttp import web
from aiohttp.http import WebSocketReader
from aiohttp.streams import StreamReader
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler
from yarl import URL

from gateway.connection_guard import (
    CloseReason,
    ConnectionClock,
    ConnectionCounts,
    ConnectionLimits,
    EventTally,
    Phase,
    address_key,
)

logger = structlog.get_logger(__name__)

# At most one log line per reason this often, however many connections it hit.
LOG_INTERVAL_S = 10.0
REFUSALS = (CloseReason.MAX_CONNECTIONS, CloseReason.MAX_CONNECTIONS_PER_ADDRESS)
_REFUSED_BODY = b"too many connections\n"
REFUSED_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY)
)


class ConnectionGuard:
    """What every connection of one site shares: the limits, the counts, the
    tally of refusals and cuts (and their log lines)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.counts = ConnectionCounts(limits)
        self._tally = EventTally(LOG_INTERVAL_S)

    def note(self, reason: CloseReason, now_s: float, address: str) -> None:
        """Count a refusal or a cut; log it unless one was logged lately."""
        num_connections = self._tally.note(reason, now_s)
        if not num_connections:
            return
        fields: dict[str, Any] = {
            "reason": reason.value,
            "num_connections": num_connections,
            "num_open": self.counts.num_connections,
        }
        if reason is CloseReason.MAX_CONNECTIONS_PER_ADDRESS:
            fields["address"] = address
        if reason in REFUSALS:
            logger.warning("connections_refused", **fields)
        elif reason is CloseReason.IDLE_TIMEOUT:
            logger.debug("connections_closed", **fields)  # a keep-alive client's routine
        else:
            logger.info("connections_closed", **fields)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's HTTP protocol, admitted by the guard's counts and held to its
    clock: cut at a missed deadline or at a request's byte bound."""

    __slots__ = ("_address", "_armed_s", "_clock", "_guard", "_timer")

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        # Whom the connection counts against; None: refused, or gone.
        self._address: str | None = None
        self._clock = ConnectionClock(guard.limits, self._loop.time())
        self._timer: asyncio.TimerHandle | None = None
        self._armed_s: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        address = address_key(_peer_host(transport))
        refusal = self._guard.counts.refusal(address)
        if refusal is not None:
            # Answered and closed before aiohttp ever serves it.
            self._guard.note(refusal, self._loop.time(), address)
            stream = cast(asyncio.Transport, transport)
            stream.write(REFUSED_RESPONSE)
            stream.close()
            return
        self._guard.counts.admit(address)
        self._address = address
        super().connection_made(transport)
        self._rearm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._address is not None:
            self._guard.counts.release(self._address)
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._address is None:
            return  # refused: closing
        clock = self._clock
        if clock.phase is Phase.UPGRADED:
            super().data_received(data)
            return
        if not clock.can_receive(len(data)):
            self._cut(CloseReason.REQUEST_TOO_LARGE)
            return
        clock.receive(len(data), self._loop.time())
        super().data_received(data)
        self._rearm()

    def set_parser(
        self, parser: WebSocketReader, data_received_cb: Callable[[], None] | None = None
    ) -> None:
        # aiohttp's websocket upgrade: from here the socket's own heartbeat rules.
        self._clock.upgrade()
        self._disarm()
        super().set_parser(parser, data_received_cb)

    def request_started(self, payload: StreamReader) -> None:
        """The application took a request (its headers are in); ``payload`` is its body."""
        body_complete = payload.is_eof()
        self._clock.start_request(body_complete, self._loop.time())
        if not body_complete:
            payload.on_eof(self._body_ended)
        self._rearm()

    def request_ended(self) -> None:
        """The application is done with the request."""
        self._clock.end_request(self._loop.time())
        self._rearm()

    def _body_ended(self) -> None:
        self._clock.end_body()
        self._rearm()

    def _rearm(self) -> None:
        """Keep one timer at the clock's deadline (none once gone or without one)."""
        deadline_s = None if self._address is None else self._clock.deadline_s()
        if deadline_s == self._armed_s:
            return
        self._disarm()
        if deadline_s is not None:
            self._timer = self._loop.call_at(deadline_s, self._on_deadline)
            self._armed_s = deadline_s

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._armed_s = None

    def _on_deadline(self) -> None:
        # Every change of the deadline re-arms the timer: this one's has passed
        # (the loop may run a timer a hair before its time).
        assert self._armed_s is not None
        now_s = max(self._loop.time(), self._armed_s)
        self._timer = None
        self._armed_s = None
        reason = self._clock.expired(now_s)
        if reason is None:
            self._rearm()
        else:
            self._cut(reason)

    def _cut(self, reason: CloseReason) -> None:
        """Close at once: what the client did not send is not waited for."""
        assert self._address is not None
        self._guard.note(reason, self._loop.time(), self._address)
        self._disarm()
        if self.transport is not None:
            self.transport.abort()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are :class:`GuardedRequestHandler`\\ s.

    The handlers are made here, not by the runner's server: aiohttp's own
    keep-alive timer is set past every deadline of the guard's (a backstop
    that never decides), and there is no access log."""

    __slots__ = ("_host", "_port", "guard")

    def __init__(self, runner: web.AppRunner, host: str, port: int, limits: ConnectionLimits):
        super().__init__(runner)
        self._host = host
        self._port = port
        self.guard = ConnectionGuard(limits)

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host, port=self._port))

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        limits = self.guard.limits
        keepalive_timeout_s = limits.idle_timeout_s + limits.header_timeout_s

        def protocol() -> GuardedRequestHandler:
            return GuardedRequestHandler(
                server,
                self.guard,
                loop=loop,
                keepalive_timeout=keepalive_timeout_s,
                access_log=None,
            )

        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog
        )
        _warn_over_file_limit(limits.max_connections)


@web.middleware
async def track_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tell a guarded connection when the application takes a request and
    when it is done with it (the first middleware: it sees every request)."""
    protocol = request.protocol
    if not isinstance(protocol, GuardedRequestHandler):
        return await handler(request)
    protocol.request_started(request.content)
    try:
        return await handler(request)
    finally:
        protocol.request_ended()


def _peer_host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return ""  # unknown (not TCP): all such count as one address


def _warn_over_file_limit(max_connections: int) -> None:
    """A cap above the process's open-file limit does not hold: accept fails first."""
    soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit != resource.RLIM_INFINITY and (
        not max_connections or max_connections >= soft_limit
    ):
        logger.warning(
            "max_connections_over_open_file_limit",
            max_connections=max_connections,
            open_file_limit=soft_limit,
        )
