"""The lifecycles of the gateway's websockets: ``/ws`` (the protocol: per
socket a reader, whose frames go to the core, and its outbox's writer) and
``/dashboard/ws`` (the scheduler's live view, pushed as its viewer may see
it). Their handshakes are ``gateway/handshake.py``'s decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus

import structlog
from aiohttp import WSCloseCode, WSMsgType, web

from gateway.connections import CLOSE_TIMEOUT_S, Connections, SocketSink, close_socket
from gateway.dashboard import Pseudonyms, unavailable_frame, view_frame
from gateway.dispatcher import Dispatcher
from gateway.handshake import SUBPROTOCOL, Admitted, HandshakeRefused
from gateway.live_feed import LiveFeed
from gateway.metrics import GatewayMetrics
from gateway.outbox import OVERFLOW_REASON, Outbox

logger = structlog.get_logger(__name__)

# A dashboard socket says nothing; what it sends is only read to notice its close.
DASHBOARD_MAX_FRAME_BYTES = 1024
# A ping every so often; a socket whose pong does not come within half of it closes.
PING_INTERVAL_S = 20.0


class SocketHandlers:
    """The handlers of ``/ws`` and ``/dashboard/ws``."""

    def __init__(
        self,
        *,
        admit: Callable[[web.Request], Admitted],
        draining: Callable[[], bool],
        dispatcher: Dispatcher,
        connections: Connections,
        metrics: GatewayMetrics,
        live: LiveFeed,
        max_frame_bytes: int,
        max_outbox_bytes: int,
    ) -> None:
        """``admit``: who a handshake is (raises HandshakeRefused);
        ``draining``: no new socket opens."""
        self._admit = admit
        self._draining = draining
        self._dispatcher = dispatcher
        self._connections = connections
        self._metrics = metrics
        self._live = live
        self._pseudonyms = Pseudonyms()
        self._max_frame_bytes = max_frame_bytes
        self._max_outbox_bytes = max_outbox_bytes

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        """``/ws``: one client's socket, served until it closes."""
        opened = await self._open(request, self._max_frame_bytes)
        if isinstance(opened, web.Response):
            return opened
        socket, admitted = opened
        await self._serve(socket, admitted, request.remote)
        return socket

    async def dashboard(self, request: web.Request) -> web.StreamResponse:
        """``/dashboard/ws``: the live view, pushed until the socket closes."""
        opened = await self._open(request, DASHBOARD_MAX_FRAME_BYTES)
        if isinstance(opened, web.Response):
            return opened
        socket, admitted = opened
        with self._connections.dashboard(socket, admitted.key_hash), self._live.watching():
            async with asyncio.TaskGroup() as tasks:
                writer = tasks.create_task(self._feed_dashboard(socket, admitted))
                async for _ in socket:
                    pass  # nothing to say: reading notices the close
                writer.cancel()
        return socket

    async def _open(
        self, request: web.Request, max_frame_bytes: int
    ) -> tuple[web.WebSocketResponse, Admitted] | web.Response:
        """The handshake: the socket, or the refusal."""
        if self._draining():
            return web.Response(
                status=HTTPStatus.SERVICE_UNAVAILABLE, text="gateway is shutting down\n"
            )
        try:
            admitted = self._admit(request)
        except HandshakeRefused as refused:
            response = web.Response(status=refused.status, text=refused.body)
            if refused.challenge:
                response.headers["WWW-Authenticate"] = 'Bearer realm="orcapod"'
            return response
        socket = web.WebSocketResponse(
            # `orcapod` when offered, never the `bearer.<key>` one.
            protocols=(SUBPROTOCOL,),
            # A frame over the limit closes its socket (1009) before it is
            # buffered, and a compressed one is never inflated past it.
            max_msg_size=max_frame_bytes,
            heartbeat=PING_INTERVAL_S,
            timeout=CLOSE_TIMEOUT_S,
        )
        if not socket.can_prepare(request).ok:
            return web.Response(
                status=HTTPStatus.BAD_REQUEST, text=f"{request.path} takes websocket handshakes\n"
            )
        await socket.prepare(request)
        return socket, admitted

    async def _serve(
        self, socket: web.WebSocketResponse, admitted: Admitted, remote: str | None
    ) -> None:
        """Read the client's frames into the core, and write what the core
        sends it, until the socket closes (or its outbox overflows)."""
        outbox = Outbox(self._max_outbox_bytes)

        async def send(frame: bytes) -> None:
            await socket.send_frame(frame, WSMsgType.TEXT)

        async def close_slow() -> None:
            await close_socket(socket, WSCloseCode.TRY_AGAIN_LATER, OVERFLOW_REASON)

        sink = SocketSink(socket, outbox)
        async with self._dispatcher.connection(admitted, sink) as socket_id:
            self._metrics.socket_opened()
            structlog.contextvars.bind_contextvars(socket_id=socket_id)
            logger.debug("socket_opened", remote=remote)
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(outbox.write_to(send))
                    tasks.create_task(outbox.close_on_overflow(close_slow))
                    try:
                        async for message in socket:
                            if message.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                                break  # an error (a frame over the limit): being closed
                            await self._dispatcher.on_client_frame(socket_id, message.data)
                            if outbox.overflowed:
                                break  # being closed: what it asks now would go nowhere
                    finally:
                        outbox.close()  # the writer sends what is queued, then ends
            finally:
                self._metrics.socket_closed()
        logger.debug("socket_closed", code=socket.close_code)

    async def _feed_dashboard(self, socket: web.WebSocketResponse, admitted: Admitted) -> None:
        """Each new snapshot, as this viewer may see it, until the socket closes."""
        version = 0
        viewer, operator = admitted.tenant.name, admitted.tenant.operator
        while not socket.closed:
            version, snapshot = await self._live.next(version)
            if snapshot is None:
                frame = unavailable_frame()
            else:
                frame = view_frame(snapshot, viewer, operator, self._pseudonyms)
            try:
                await socket.send_frame(frame, WSMsgType.TEXT)
            except ConnectionError:
                return
