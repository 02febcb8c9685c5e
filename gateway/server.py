"""The gateway actor: the asyncio shell around :class:`gateway.session.GatewaySession`.

Owns the gateway's tasks and the order they start and stop in: the aiohttp
server on the gateway's one port (``/ws``, the websocket, whose handshake's
decision is ``gateway/handshake.py``'s; the OpenAI API,
``gateway/openai_endpoint.py``; ``/health``, ``/healthz``, ``/metrics``), per
socket one reader and one writer (``gateway/outbox.py``), the tokens channel
(``gateway/token_channel.py``), the
log follower (``gateway/log_reader.py``), the tokenizer threads
(``gateway/tokenizer_pool.py``), the tenant table's reloader, the heartbeat.
Writes to Redis are ``gateway/upstream.py``'s. Every task is owned by a
TaskGroup and awaited; shutdown is described in ``docs/architecture.md``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Protocol

import structlog
from aiohttp import WSCloseCode, WSMsgType, web
from redis.exceptions import AuthenticationError, RedisError
from websockets.datastructures import Headers

from gateway.actions import (
    Action,
    DeadLetter,
    FollowLog,
    LoadLog,
    PostUpstream,
    SendFrame,
    ServerFrame,
    Tokenize,
    Wait,
)
from gateway.admission import AdmissionLimits
from gateway.connection_guard import ConnectionLimits
from gateway.dashboard import Pseudonyms, unavailable_frame, view_frame
from gateway.guarded_site import GuardedSite, track_requests
from gateway.handshake import SUBPROTOCOL, Admitted, HandshakeRefused, decide
from gateway.host_guard import host_guard, own_names
from gateway.live_feed import LiveFeed
from gateway.log_reader import LogReader
from gateway.metrics import GatewayMetrics
from gateway.openai_api import OpenAIError, unauthorized
from gateway.openai_endpoint import Exchange, OpenAIEndpoint, shutting_down
from gateway.outbox import OVERFLOW_REASON, Outbox
from gateway.session import GatewaySession, SessionConfig
from gateway.tenant_loader import TenantLoader
from gateway.tenants import OPEN_TENANT, Tenant, UnprotectedHostError, is_loopback_host
from gateway.token_channel import TokenChannel
from gateway.tokenize_queue import TokenizeQueueLimits, TokenizerQueueFull
from gateway.tokenizer import ChatTokenizer
from gateway.tokenizer_pool import TokenizerPool
from gateway.upstream import UpstreamWriter
from gateway.validation import ModelLimits, RequestValidationError
from shared.heartbeat import heartbeat_ttl_ms, sleep_unless_set, wait_any
from shared.keys import RedisKeys
from shared.metrics_http import METRICS_PATH, metrics_handler
from shared.protocol import Error, encode_json
from shared.redis_streams import connect, reconnect_backoff_s
from shared.settings import GatewaySettings, served_model_name

logger = structlog.get_logger(__name__)

WS_PATH = "/ws"
DASHBOARD_WS_PATH = "/dashboard/ws"
STATIC_DIR = Path(__file__).resolve().parent / "static"
# The pages run only their own scripts, talk only to this gateway, and are never framed.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# A dashboard socket says nothing; what it sends is only read to notice its close.
DASHBOARD_MAX_FRAME_BYTES = 1024
HEALTH_PATH = "/healthz"
# vLLM's and llama.cpp's name for the same check.
HEALTH_ALIAS_PATH = "/health"
# A ping every so often; a socket whose pong does not come within half of it closes.
PING_INTERVAL_S = 20.0
# How long a closing socket waits for the client's close frame.
CLOSE_TIMEOUT_S = 5.0
# After the drain, how long the HTTP server waits for its handlers before cancelling them.
SHUTDOWN_TIMEOUT_S = 1.0
DRAIN_POLL_S = 0.05
HEALTH_TIMEOUT_S = 1.0
REDIS_TIMEOUT_S = 5.0
REVOKED_REASON = "API key revoked"
INTERNAL_MESSAGE = "internal error"


class GatewayServer:
    """One gateway process's I/O; ``run`` serves until ``stop`` is set."""

    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: ChatTokenizer,
        limits: ModelLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._keys = RedisKeys(settings.redis.prefix)
        self._session = GatewaySession(
            SessionConfig(
                gateway_id=settings.gateway_id,
                max_frame_bytes=settings.max_frame_bytes,
                admission=AdmissionLimits(
                    max_requests_per_socket=settings.max_requests_per_socket,
                    max_requests_per_tenant=settings.max_requests_per_tenant,
                    default_max_queued=settings.default_max_queued,
                ),
                detach_grace_s=settings.detach_grace_s,
                stall_timeout_s=settings.request_stall_timeout_s,
                max_refused_chars_per_s=settings.max_refused_chars_per_s,
            ),
            tokenizer,
            limits,
            clock,
        )
        self._redis = connect(settings.redis.url, socket_timeout_s=REDIS_TIMEOUT_S)
        self._tenants = TenantLoader(settings.tenants_file, self._redis, self._keys.tenants)
        self._tenants_reload = asyncio.Event()
        # Decided once, at start (``_load_tenants``): keys that go away later
        # never open the gateway.
        self._open_tenant: Tenant | None = None
        # Where the core's frames for each socket go: a websocket's outbox, or
        # an OpenAI request's exchange (a virtual socket of its own).
        self._sinks: dict[int, _FrameSink] = {}
        self._websockets: dict[int, web.WebSocketResponse] = {}
        # Open dashboard sockets, with the hash of the key each presented.
        self._dashboards: dict[web.WebSocketResponse, str | None] = {}
        self._live = LiveFeed(self._redis, self._keys.live_stats)
        self._pseudonyms = Pseudonyms()
        served_model = served_model_name(settings.model.model_dir)
        self.metrics = GatewayMetrics(settings.gateway_id, served_model)
        self._openai = OpenAIEndpoint(
            self,
            served_model=served_model,
            context_tokens=limits.context_tokens,
            max_body_bytes=settings.max_frame_bytes,
            max_outbox_bytes=settings.max_outbox_bytes,
            on_started=self.metrics.http_request_started,
            on_ended=self.metrics.http_request_ended,
        )
        self._readers_stop = asyncio.Event()
        self._upstream = UpstreamWriter(
            self._redis, self._keys, self._session, settings.redis.log_retention_s
        )
        self._logs = LogReader(self._redis, self._keys, self._session, self._apply)
        self._channel = TokenChannel(
            self._redis,
            self._keys.tokens(settings.gateway_id),
            self._on_gateway_message,
            lambda: self._logs.catch_up(self._readers_stop),
        )
        self._pool = TokenizerPool(
            tokenizer,
            limits,
            settings.tokenizer_threads,
            TokenizeQueueLimits(
                max_jobs=settings.max_tokenizing,
                max_chars=settings.max_tokenizing_chars,
                max_chars_per_tenant=settings.max_tokenizing_chars_per_tenant,
            ),
        )
        self.listening = asyncio.Event()
        self.port: int | None = None

    @property
    def session(self) -> GatewaySession:
        """The protocol core (for inspection in tests)."""
        return self._session

    @property
    def draining(self) -> bool:
        """Shutting down: new requests and sockets are refused."""
        return self._session.draining

    @property
    def url(self) -> str:
        """The websocket endpoint, once listening."""
        return f"ws://{self.settings.host}:{self.port}{WS_PATH}"

    @property
    def http_url(self) -> str:
        """The HTTP root (the OpenAI API is under ``/v1``), once listening."""
        return f"http://{self.settings.host}:{self.port}"

    def request_tenants_reload(self) -> None:
        """Re-read the tenants file and hash now (SIGHUP), not at the next poll."""
        self._tenants_reload.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down in order. Raises
        TenantConfigError for a broken tenants file, and UnprotectedHostError
        when asked to listen beyond loopback without any API key."""
        try:
            if not await self._load_tenants(stop):
                return
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._channel.read_until(self._readers_stop), name="tokens")
                tasks.create_task(self._heartbeat(), name="gateway-heartbeat")
                tasks.create_task(self._watch_tenants(), name="gateway-tenants")
                tasks.create_task(self._logs.follow_until(self._readers_stop), name="gateway-logs")
                tasks.create_task(self._live.poll_until(self._readers_stop), name="gateway-live")
                try:
                    # Serve only once tokens can reach us: a request accepted
                    # before the SUBSCRIBE is in place could lose its first tokens.
                    await wait_any(self._channel.subscribed, stop)
                    if not stop.is_set():
                        await self._serve(stop)
                finally:
                    self._readers_stop.set()
        finally:
            self._pool.close()
            await self._redis.aclose()
            logger.info("gateway stopped")

    async def _serve(self, stop: asyncio.Event) -> None:
        app = web.Application(
            client_max_size=self.settings.max_frame_bytes,
            middlewares=[
                track_requests,
                host_guard(
                    lambda: self._open_tenant is not None,
                    own_names(self.settings.host),
                    self.settings.allowed_hosts,
                ),
            ],
        )
        app.router.add_get(WS_PATH, self._websocket)
        app.router.add_get(DASHBOARD_WS_PATH, self._dashboard_socket)
        app.router.add_get("/", _page("chat.html"))
        app.router.add_get("/dashboard", _page("dashboard.html"))
        app.router.add_static("/static", STATIC_DIR, follow_symlinks=False)
        app.router.add_get(HEALTH_PATH, self._health)
        app.router.add_get(HEALTH_ALIAS_PATH, self._health)
        app.router.add_get(METRICS_PATH, metrics_handler(self.metrics.registry))
        self._openai.add_routes(app)
        # handler_cancellation: a client that goes away cancels its handler at
        # once, and with it its request. The connections' own settings (no
        # access log, the guard's timeouts) are the site's.
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        settings = self.settings
        limits = ConnectionLimits(
            idle_timeout_s=settings.idle_timeout_s,
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            max_connections=settings.max_connections,
            max_connections_per_address=settings.max_connections_per_address,
            max_body_bytes=settings.max_frame_bytes,
        )
        await runner.setup()
        try:
            site = GuardedSite(runner, settings.host, settings.port, limits)
            await site.start()
            self.port = int(runner.addresses[0][1])
            logger.info(
                "gateway listening",
                url=self.url,
                openai_base_url=f"{self.http_url}/v1",
                gateway_id=self.settings.gateway_id,
            )
            self.listening.set()
            await stop.wait()
            await self._drain(site)
        finally:
            # Cancels the handlers still running: their requests are cancelled upstream.
            await runner.cleanup()

    async def _drain(self, site: web.BaseSite) -> None:
        """Stop listening and refuse new requests; wait (at most the drain timeout)
        for the requests in flight and their last frames; then close every socket."""
        # Open connections stay open; a request on one now gets a 503.
        await site.stop()
        self._session.start_draining()
        logger.info(
            "gateway draining",
            num_sockets=self._session.num_sockets,
            num_requests=self._session.num_live_requests,
            drain_timeout_s=self.settings.drain_timeout_s,
        )
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + self.settings.drain_timeout_s
        while self._has_unsent_work() and loop.time() < deadline_s:
            await asyncio.sleep(DRAIN_POLL_S)
        # An HTTP response still running ends with an error (an error event and
        # [DONE] once streaming), not with a cut its client cannot tell from a
        # network fault; it gets a moment to send it.
        self._end_exchanges(shutting_down, lambda socket_id: True)
        deadline_s = loop.time() + SHUTDOWN_TIMEOUT_S
        while self._has_unsent_frames() and loop.time() < deadline_s:
            await asyncio.sleep(DRAIN_POLL_S)
        # A writer that just took the last frame from its outbox sends it now.
        await asyncio.sleep(0)
        logger.info(
            "gateway shutting down",
            num_sockets=self._session.num_sockets,
            num_unfinished=self._session.num_live_requests,
        )
        async with asyncio.TaskGroup() as closing:
            for socket in [*self._websockets.values(), *self._dashboards]:
                closing.create_task(
                    socket.close(code=WSCloseCode.GOING_AWAY, message=b"gateway is shutting down")
                )

    def _has_unsent_work(self) -> bool:
        """Requests in flight, or frames not yet handed to their connection."""
        return self._session.num_live_requests > 0 or self._has_unsent_frames()

    def _has_unsent_frames(self) -> bool:
        return any(not sink.outbox.is_empty for sink in self._sinks.values())

    def _end_exchanges(
        self, error: Callable[[], OpenAIError], which: Callable[[int], bool]
    ) -> None:
        """End each HTTP response whose virtual socket is ``which`` with
        ``error()``; its handler then cancels what still runs."""
        for socket_id, sink in self._sinks.items():
            if isinstance(sink, Exchange) and which(socket_id):
                sink.end_with(error())

    # --- HTTP ------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if await self._is_ready():
            return web.Response(text="ready\n")
        return web.Response(status=HTTPStatus.SERVICE_UNAVAILABLE, text="no worker is ready\n")

    def admit(self, request: web.Request) -> Admitted:
        """Who a request or handshake is; raises HandshakeRefused (401, 403)."""
        try:
            return decide(
                Headers(list(request.headers.items())),
                self._tenants.table,
                open_tenant=self._open_tenant,
                allowed_origins=self.settings.allowed_origins,
            )
        except HandshakeRefused as refused:
            logger.info("request refused", status=int(refused.status), reason=refused.body.strip())
            raise

    async def _is_ready(self) -> bool:
        """The scheduler keeps the ready key alive while at least one worker is registered."""
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                return bool(await self._redis.exists(self._keys.ready))
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("health check cannot reach redis", error=str(error))
            return False

    # --- OpenAI requests: one virtual socket each --------------------------------------

    def open_exchange(self, admitted: Admitted, exchange: Exchange) -> int:
        socket_id = self._session.connect(admitted.tenant, admitted.key_hash, resumable=False)
        self._sinks[socket_id] = exchange
        return socket_id

    async def close_exchange(self, socket_id: int) -> None:
        del self._sinks[socket_id]
        # Not resumable: what still runs is cancelled at once.
        await self._apply(self._session.disconnect(socket_id, resumable=False))

    async def apply(self, actions: list[Action]) -> None:
        """Carry out the core's actions (for the OpenAI endpoint)."""
        await self._apply(actions)

    # --- sockets ---------------------------------------------------------------------

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        opened = await self._open_socket(request, self.settings.max_frame_bytes)
        if isinstance(opened, web.Response):
            return opened
        socket, admitted = opened
        await self._serve_socket(socket, admitted, request.remote)
        return socket

    async def _open_socket(
        self, request: web.Request, max_frame_bytes: int
    ) -> tuple[web.WebSocketResponse, Admitted] | web.Response:
        """The handshake of ``/ws`` and ``/dashboard/ws``: the socket, or the refusal."""
        if self._session.draining:
            return web.Response(
                status=HTTPStatus.SERVICE_UNAVAILABLE, text="gateway is shutting down\n"
            )
        try:
            admitted = self.admit(request)
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

    async def _dashboard_socket(self, request: web.Request) -> web.StreamResponse:
        opened = await self._open_socket(request, DASHBOARD_MAX_FRAME_BYTES)
        if isinstance(opened, web.Response):
            return opened
        socket, admitted = opened
        self._dashboards[socket] = admitted.key_hash
        try:
            with self._live.watching():
                async with asyncio.TaskGroup() as tasks:
                    writer = tasks.create_task(self._feed_dashboard(socket, admitted))
                    async for _ in socket:
                        pass  # nothing to say: reading notices the close
                    writer.cancel()
        finally:
            del self._dashboards[socket]
        return socket

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

    async def _serve_socket(
        self, socket: web.WebSocketResponse, admitted: Admitted, remote: str | None
    ) -> None:
        socket_id = self._session.connect(admitted.tenant, admitted.key_hash)
        outbox = Outbox(self.settings.max_outbox_bytes)
        self._sinks[socket_id] = _SocketSink(outbox)
        self._websockets[socket_id] = socket
        self.metrics.socket_opened()
        structlog.contextvars.bind_contextvars(socket_id=socket_id)
        logger.debug("socket opened", remote=remote)

        async def send(frame: bytes) -> None:
            await socket.send_frame(frame, WSMsgType.TEXT)

        async def close_slow() -> None:
            await _close_socket(socket, WSCloseCode.TRY_AGAIN_LATER, OVERFLOW_REASON)

        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(outbox.write_to(send))
                tasks.create_task(outbox.close_on_overflow(close_slow))
                try:
                    async for message in socket:
                        if message.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                            break  # an error (a frame over the limit): being closed
                        await self._apply(self._on_frame(socket_id, message.data))
                        if outbox.overflowed:
                            break  # being closed: what it asks now would go nowhere
                finally:
                    outbox.close()  # the writer sends what is queued, then ends
        finally:
            del self._sinks[socket_id]
            del self._websockets[socket_id]
            self.metrics.socket_closed(socket_id)
            await self._apply(self._session.disconnect(socket_id))
            logger.debug("socket closed", code=socket.close_code)

    def _on_frame(self, socket_id: int, frame: str | bytes) -> list[Action]:
        try:
            return self._session.on_frame(socket_id, frame)
        except Exception:
            # A bug must not take the socket (or the gateway) down with it.
            logger.exception("client frame failed")
            return [SendFrame(socket_id, Error(code="internal", message=INTERNAL_MESSAGE))]

    async def _on_gateway_message(self, data: bytes) -> None:
        channel = self._channel.channel
        try:
            actions = self._session.on_gateway_message(data, channel)
        except Exception as error:
            # The reader serves every socket of this gateway: keep it alive.
            logger.exception("gateway message failed", channel=channel)
            actions = [DeadLetter(source=channel, error=repr(error), data=data)]
        await self._apply(actions)

    # --- the core's actions ----------------------------------------------------------

    async def _apply(self, actions: list[Action]) -> None:
        """Carry out the core's actions in order."""
        for action in actions:
            if isinstance(action, SendFrame):
                self._send(action)
            elif isinstance(action, Tokenize):
                # Awaited by the socket's own reader: its frames are answered in
                # the order sent, and one socket holds at most one pool slot.
                await self._tokenize(action)
            elif isinstance(action, PostUpstream):
                await self._apply(await self._upstream.post(action))
            elif isinstance(action, DeadLetter):
                await self._upstream.dead_letter(action)
            elif isinstance(action, LoadLog):
                await self._logs.load(action)
            elif isinstance(action, FollowLog):
                self._logs.follow(action)
            elif isinstance(action, Wait):
                # Awaited by the reader of the socket (or HTTP request) that
                # was refused: it reads nothing meanwhile.
                await asyncio.sleep(action.duration_s)

    def _send(self, action: SendFrame) -> None:
        sink = self._sinks.get(action.socket_id)
        if sink is None:  # the connection closed meanwhile
            return
        if sink.outbox.overflowed:
            return
        self.metrics.on_frame(action.socket_id, action.frame, time.monotonic())
        if not sink.put(action.frame):
            # The outbox closes the connection (a socket with 1013); its
            # requests detach (or, for an HTTP request, end) as on any close.
            logger.warning(
                "connection outbox over its limit", max_bytes=self.settings.max_outbox_bytes
            )

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
        except TokenizerQueueFull as full:
            actions = self._session.on_tokenize_failed(
                action.request_id, "queue_full", full.message, action.num_chars
            )
        except RequestValidationError as error:
            actions = self._session.on_tokenize_failed(
                action.request_id, error.code, error.message, action.num_chars
            )
        except Exception:
            logger.exception("tokenizing failed", request_id=action.request_id)
            actions = self._session.on_tokenize_failed(
                action.request_id, "internal", INTERNAL_MESSAGE
            )
        else:
            actions = self._session.on_tokenized(action.request_id, action.generate, validated)
        await self._apply(actions)

    # --- tenants, heartbeat ----------------------------------------------------------

    async def _load_tenants(self, stop: asyncio.Event) -> bool:
        """The first tenant table (waits for Redis, until ``stop``: then False),
        and the one decision whether keyless clients are served."""
        failures = 0
        while True:
            try:
                await self._tenants.load()
                break
            except AuthenticationError:
                raise  # a wrong password stays wrong: no retry helps
            except (RedisError, OSError) as error:
                logger.warning("cannot read the tenants hash yet", error=str(error))
            await sleep_unless_set(stop, reconnect_backoff_s(failures))
            if stop.is_set():
                return False
            failures += 1
        num_keys = self._tenants.table.num_keys
        if self.settings.open or (num_keys == 0 and is_loopback_host(self.settings.host)):
            self._open_tenant = OPEN_TENANT
            logger.info("keyless clients are served as the open tenant", num_keys=num_keys)
        elif num_keys == 0:
            raise UnprotectedHostError(
                f"no API keys are configured (tenants file: {self.settings.tenants_file}, "
                f"Redis hash: {self._keys.tenants}), so the gateway would be open to anyone "
                f"on {self.settings.host}; add keys, listen on 127.0.0.1, or pass --open"
            )
        return True

    async def _watch_tenants(self) -> None:
        """Re-read the tenants every ``tenants_reload_s`` (the file only when it
        changed), and at once when asked (SIGHUP), until shutdown; close the
        sockets of keys that are gone."""
        while not self._readers_stop.is_set():
            try:
                async with asyncio.timeout(self.settings.tenants_reload_s):
                    await wait_any(self._tenants_reload, self._readers_stop)
            except TimeoutError:
                pass
            if self._readers_stop.is_set():
                return
            forced = self._tenants_reload.is_set()
            self._tenants_reload.clear()
            if await self._tenants.reload(force_file=forced):
                await self._close_revoked()

    async def _close_revoked(self) -> None:
        valid = self._tenants.table.by_hash.keys()
        revoked = self._session.table.sockets_without_key(valid)
        if revoked:
            logger.info("closing the sockets of revoked keys", num_sockets=len(revoked))
        self._end_exchanges(lambda: unauthorized(REVOKED_REASON), set(revoked).__contains__)
        dashboards = [
            socket
            for socket, key_hash in self._dashboards.items()
            if key_hash is not None and key_hash not in valid
        ]
        async with asyncio.TaskGroup() as closing:
            sockets = [self._websockets.get(socket_id) for socket_id in revoked]
            for socket in [*dashboards, *sockets]:
                if socket is not None:
                    closing.create_task(
                        _close_socket(socket, WSCloseCode.POLICY_VIOLATION, REVOKED_REASON)
                    )

    async def _heartbeat(self) -> None:
        """Keep this gateway's heartbeat key alive until shutdown, and let the
        session's clock tick."""
        key = self._keys.gateway_heartbeat(self.settings.gateway_id)
        ttl_ms = heartbeat_ttl_ms(self.settings.heartbeat_s)
        while not self._readers_stop.is_set():
            try:
                await self._redis.set(key, self.settings.gateway_id, px=ttl_ms)
            except (RedisError, OSError) as error:
                logger.warning("heartbeat failed", error=str(error))
            # Requests left by a closed socket and not resumed in time, and
            # requests that stalled, end now.
            await self._apply(self._session.on_tick())
            await sleep_unless_set(self._readers_stop, self.settings.heartbeat_s)
        try:
            await self._redis.delete(key)
        except (RedisError, OSError) as error:
            logger.warning("could not remove the heartbeat key", error=str(error))


class _FrameSink(Protocol):
    """Where the core's frames for one socket go."""

    @property
    def outbox(self) -> Outbox: ...

    def put(self, frame: ServerFrame) -> bool:
        """Queue ``frame``; False once the outbox is over its cap."""
        ...


class _SocketSink:
    """A websocket's frames: their JSON text, in its outbox."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def put(self, frame: ServerFrame) -> bool:
        return self.outbox.put(encode_json(frame).encode())


async def _close_socket(socket: web.WebSocketResponse, code: int, reason: str) -> None:
    """Close with ``code``; a peer that reads nothing cannot hold the close up."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await socket.close(code=code, message=reason.encode())
    except (TimeoutError, ConnectionError):
        pass


def _page(name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler serving one page of ``gateway/static`` with the pages' headers.

    The page holds no data: what it shows comes over its websocket, which
    asks for the API key as every socket does."""
    path = STATIC_DIR / name

    async def serve(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(path, headers=PAGE_HEADERS)

    return serve
