"""The gateway actor: the asyncio shell around :class:`gateway.session.GatewaySession`.

It owns the I/O and nothing else: a websockets server (``/ws``, ``/healthz``),
one redis.asyncio client, one pub/sub reader for the gateway's tokens
channel, one follower of request logs (``gateway/log_reader.py``), the
tenant table's reloader, one heartbeat, and per socket one reader and one
writer. Every task
is owned by a TaskGroup and awaited. Shutdown, when ``stop`` is set, is
ordered: stop accepting sockets and refuse new requests, let the requests in
flight finish (at most ``drain_timeout_s``), close every socket (which cancels
what is left upstream), then stop the reader and the heartbeat, then close Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from http import HTTPStatus
from urllib.parse import urlsplit

import structlog
from redis.exceptions import AuthenticationError, RedisError
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidHeader
from websockets.frames import CloseCode
from websockets.headers import parse_subprotocol
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from gateway.actions import Action, DeadLetter, FollowLog, LoadLog, PostUpstream, SendFrame
from gateway.log_reader import LogReader
from gateway.session import GatewaySession, SessionConfig
from gateway.tenant_loader import TenantLoader
from gateway.tenants import (
    SUBPROTOCOL,
    TOKENS_WINDOW_S,
    AuthError,
    Tenant,
    TokenReservation,
    UnprotectedHostError,
    authenticate,
    is_loopback_host,
    over_tokens_per_minute,
    presented_key,
    tokens_window,
)
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import RequestRecord, SubmitRequest, encode
from shared.protocol import Error, encode_json
from shared.redis_streams import connect, reconnect_backoff_s
from shared.request_log import (
    queue_end,
    queue_record,
)
from shared.settings import GatewaySettings

logger = structlog.get_logger(__name__)

WS_PATH = "/ws"
HEALTH_PATH = "/healthz"
# websockets' own limit, far above ours: an oversized frame still arrives, so
# the client gets an `error` it can act on instead of a closed socket.
LIBRARY_MAX_SIZE_FACTOR = 16
POLL_S = 0.5
DRAIN_POLL_S = 0.05
HEALTH_TIMEOUT_S = 1.0
REDIS_TIMEOUT_S = 5.0
DEAD_STREAM_MAX_LEN = 10_000


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
                max_requests_per_socket=settings.max_requests_per_socket,
                detach_grace_s=settings.detach_grace_s,
            ),
            tokenizer,
            limits,
            clock,
        )
        self._redis = connect(settings.redis.url, socket_timeout_s=REDIS_TIMEOUT_S)
        self._tenants = TenantLoader(settings.tenants_file, self._redis, self._keys.tenants)
        self._tenants_reload = asyncio.Event()
        # Without any key the gateway is open, which only loopback may be.
        self._open_allowed = is_loopback_host(settings.host)
        # The tenant each handshake authenticated, until its socket handler takes it.
        self._handshake_tenants: weakref.WeakKeyDictionary[ServerConnection, Tenant] = (
            weakref.WeakKeyDictionary()
        )
        # Frames for each open socket, sent by that socket's writer task, so a
        # slow client never stalls the pub/sub reader that feeds everyone. Not
        # bounded here: a socket's frames are bounded by its in-flight limit
        # times max_tokens, and keepalive pings drop dead peers.
        self._outboxes: dict[int, asyncio.Queue[str | None]] = {}
        self._readers_stop = asyncio.Event()
        self._logs = LogReader(self._redis, self._keys, self._session, self._apply)
        self.listening = asyncio.Event()
        self.port: int | None = None

    @property
    def session(self) -> GatewaySession:
        """The protocol core (for inspection in tests)."""
        return self._session

    @property
    def url(self) -> str:
        """The websocket endpoint, once listening."""
        return f"ws://{self.settings.host}:{self.port}{WS_PATH}"

    def request_tenants_reload(self) -> None:
        """Re-read the tenants file and hash now (SIGHUP), not at the next poll."""
        self._tenants_reload.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down in order. Raises
        TenantConfigError for a broken tenants file, and UnprotectedHostError
        when asked to listen beyond loopback without any API key."""
        subscribed = asyncio.Event()
        try:
            await self._load_tenants(stop)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._read_tokens(subscribed), name="gateway-tokens")
                tasks.create_task(self._heartbeat(), name="gateway-heartbeat")
                tasks.create_task(self._watch_tenants(), name="gateway-tenants")
                tasks.create_task(self._logs.follow_until(self._readers_stop), name="gateway-logs")
                try:
                    # Serve only once tokens can reach us: a request accepted
                    # before the SUBSCRIBE is in place could lose its first tokens.
                    await _wait_any(subscribed, stop)
                    if not stop.is_set():
                        await self._serve(stop)
                finally:
                    self._readers_stop.set()
        finally:
            await self._redis.aclose()
            logger.info("gateway stopped")

    async def _serve(self, stop: asyncio.Event) -> None:
        async with serve(
            self._serve_socket,
            self.settings.host,
            self.settings.port,
            process_request=self._process_request,
            select_subprotocol=_select_subprotocol,
            max_size=LIBRARY_MAX_SIZE_FACTOR * self.settings.max_frame_bytes,
        ) as server:
            self.port = int(next(iter(server.sockets)).getsockname()[1])
            logger.info("gateway listening", url=self.url, gateway_id=self.settings.gateway_id)
            self.listening.set()
            await stop.wait()
            await self._drain(server)
        # Leaving `serve` closed every socket and awaited its handler, so every
        # request still live has been cancelled upstream by now.

    async def _drain(self, server: Server) -> None:
        """Stop listening and refuse new requests; wait (at most the drain timeout)
        for the requests in flight and their last frames; then close every socket."""
        # Open sockets stay open; connections still in their handshake get a 503.
        server.close(close_connections=False)
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
        # A writer that just took the last frame from its outbox sends it now.
        await asyncio.sleep(0)
        logger.info(
            "gateway shutting down",
            num_sockets=self._session.num_sockets,
            num_unfinished=self._session.num_live_requests,
        )
        async with asyncio.TaskGroup() as closing:
            for connection in server.connections:
                closing.create_task(
                    connection.close(CloseCode.GOING_AWAY, "gateway is shutting down")
                )

    def _has_unsent_work(self) -> bool:
        """Requests in flight, or frames not yet handed to their socket."""
        return self._session.num_live_requests > 0 or any(
            not outbox.empty() for outbox in self._outboxes.values()
        )

    # --- HTTP ------------------------------------------------------------------------

    async def _process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        path = urlsplit(request.path).path
        if path == HEALTH_PATH:
            if await self._is_ready():
                return connection.respond(HTTPStatus.OK, "ready\n")
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "no worker is ready\n")
        if path != WS_PATH:
            return connection.respond(
                HTTPStatus.NOT_FOUND, f"not found; the endpoint is {WS_PATH}\n"
            )
        key = presented_key(request.headers.get("Authorization"), _offered_subprotocols(request))
        try:
            tenant = authenticate(self._tenants.table, key, open_allowed=self._open_allowed)
        except AuthError as error:
            logger.info("handshake refused", reason=str(error).strip())
            response = connection.respond(HTTPStatus.UNAUTHORIZED, str(error))
            response.headers["WWW-Authenticate"] = 'Bearer realm="orcapod"'
            return response
        self._handshake_tenants[connection] = tenant
        return None

    async def _is_ready(self) -> bool:
        """The scheduler keeps the ready key alive while at least one worker is registered."""
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                return bool(await self._redis.exists(self._keys.ready))
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("health check cannot reach redis", error=str(error))
            return False

    # --- sockets ---------------------------------------------------------------------

    async def _serve_socket(self, connection: ServerConnection) -> None:
        socket_id = self._session.connect(self._handshake_tenants.pop(connection))
        outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self._outboxes[socket_id] = outbox
        structlog.contextvars.bind_contextvars(socket_id=socket_id)
        logger.debug("socket opened", remote=str(connection.remote_address))
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(_write_frames(connection, outbox))
                try:
                    async for frame in connection:
                        await self._apply(self._on_frame(socket_id, frame))
                except ConnectionClosed:
                    pass
                finally:
                    outbox.put_nowait(None)  # the writer sends what is queued, then ends
        finally:
            del self._outboxes[socket_id]
            await self._apply(self._session.disconnect(socket_id))
            logger.debug("socket closed", code=connection.close_code)

    # --- Redis -----------------------------------------------------------------------

    async def _read_tokens(self, subscribed: asyncio.Event) -> None:
        """The one pub/sub reader: TokenBatch and RequestRejected for this gateway."""
        channel = self._keys.tokens(self.settings.gateway_id)
        pubsub = self._redis.pubsub()
        failures = 0
        # Our own flag: a SUBSCRIBE that failed to connect leaves redis-py's
        # `subscribed` true without a connection to read from.
        needs_subscribe = True
        try:
            while not self._readers_stop.is_set():
                try:
                    if needs_subscribe:
                        await pubsub.subscribe(channel)
                        needs_subscribe = False
                    message = await pubsub.get_message(timeout=POLL_S)
                except AuthenticationError:
                    raise  # a wrong password stays wrong: no retry helps
                except (RedisError, OSError) as error:
                    # A fresh subscription on a fresh connection: redis-py's own
                    # reconnect of a broken pub/sub connection can keep failing
                    # long after Redis is back. What was published meanwhile is
                    # read from the requests' logs once subscribed again.
                    logger.warning("tokens channel unreachable", error=str(error))
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.aclose()
                    pubsub = self._redis.pubsub()
                    needs_subscribe = True
                    await self._sleep_unless_stopping(reconnect_backoff_s(failures))
                    failures += 1
                    continue
                failures = 0
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    logger.info("subscribed", channel=channel)
                    if subscribed.is_set():
                        await self._logs.catch_up(self._readers_stop)
                    subscribed.set()
                elif message["type"] == "message":
                    await self._apply(self._on_gateway_message(message["data"], channel))
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()

    def _on_frame(self, socket_id: int, frame: str | bytes) -> list[Action]:
        try:
            return self._session.on_frame(socket_id, frame)
        except Exception as error:
            # A bug must not take the socket (or the gateway) down with it.
            logger.exception("client frame failed")
            return [SendFrame(socket_id, Error(code="internal", message=repr(error)))]

    def _on_gateway_message(self, data: bytes, channel: str) -> list[Action]:
        try:
            return self._session.on_gateway_message(data, channel)
        except Exception as error:
            # The reader serves every socket of this gateway: keep it alive.
            logger.exception("gateway message failed", channel=channel)
            return [DeadLetter(source=channel, error=repr(error), data=data)]

    async def _heartbeat(self) -> None:
        """Keep this gateway's heartbeat key alive (TTL a few beats) until
        shutdown, and let the session's clock tick."""
        key = self._keys.gateway_heartbeat(self.settings.gateway_id)
        ttl_ms = max(int(3_000 * self.settings.heartbeat_s), 1_000)
        while not self._readers_stop.is_set():
            try:
                await self._redis.set(key, self.settings.gateway_id, px=ttl_ms)
            except (RedisError, OSError) as error:
                logger.warning("heartbeat failed", error=str(error))
            # Requests left by a closed socket and not resumed in time end now.
            await self._apply(self._session.on_tick())
            await self._sleep_unless_stopping(self.settings.heartbeat_s)
        try:
            await self._redis.delete(key)
        except (RedisError, OSError) as error:
            logger.warning("could not remove the heartbeat key", error=str(error))

    async def _apply(self, actions: list[Action]) -> None:
        """Carry out the core's actions in order."""
        for action in actions:
            if isinstance(action, SendFrame):
                outbox = self._outboxes.get(action.socket_id)
                if outbox is not None:  # else the socket closed meanwhile
                    outbox.put_nowait(encode_json(action.frame))
            elif isinstance(action, PostUpstream):
                await self._post_upstream(action)
            elif isinstance(action, DeadLetter):
                await self._dead_letter(action)
            elif isinstance(action, LoadLog):
                await self._logs.load(action)
            elif isinstance(action, FollowLog):
                self._logs.follow(action)

    async def _post_upstream(self, action: PostUpstream) -> None:
        message = action.message
        if action.reservation is not None and isinstance(message, SubmitRequest):
            refusal = await self._reserve_tokens(action.reservation, message.request_id)
            if refusal:
                await self._apply(refusal)
                return
        is_submit = isinstance(message, SubmitRequest)
        stream = self._keys.requests if is_submit else self._keys.control
        try:
            # One transaction: a request is submitted only with its log started.
            pipe = self._redis.pipeline(transaction=True)
            if isinstance(action.log_entry, RequestRecord):
                queue_record(pipe, self._keys, action.log_entry)
            elif action.log_entry is not None:
                queue_end(pipe, self._keys, action.log_entry, self.settings.redis.log_retention_s)
            pipe.xadd(stream, {MESSAGE_FIELD: encode(message)})
            await pipe.execute()
        except (RedisError, OSError) as error:
            logger.error(
                "could not post upstream",
                request_id=message.request_id,
                stream=stream,
                error=str(error),
            )
            if is_submit:
                await self._apply(self._session.on_submit_failed(message.request_id, str(error)))
        except Exception as error:
            # A bug (a message that cannot be encoded, say) ends this request
            # with an error; it must not take the socket down with it.
            logger.exception("posting upstream failed", request_id=message.request_id)
            if is_submit:
                await self._apply(self._session.on_submit_failed(message.request_id, repr(error)))

    async def _reserve_tokens(
        self, reservation: TokenReservation, request_id: str
    ) -> list[Action] | None:
        """Take the request's tokens from its tenant's budget of this minute, in a
        counter all gateways share; the actions that end it when over (else None)."""
        window, retry_in_s = tokens_window(time.time())
        key = self._keys.tenant_tokens(reservation.tenant, window)
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.incrby(key, reservation.num_tokens)
            # Two windows: the counter outlives its minute even on a skewed clock.
            pipe.expire(key, 2 * TOKENS_WINDOW_S)
            num_reserved, _ = await pipe.execute()
            if int(num_reserved) <= reservation.tokens_per_minute:
                return None
            # A refused request takes nothing: give its tokens back.
            await self._redis.decrby(key, reservation.num_tokens)
        except (RedisError, OSError) as error:
            logger.error("could not reserve tokens", request_id=request_id, error=str(error))
            return self._session.on_submit_failed(request_id, str(error))
        message = over_tokens_per_minute(
            reservation, int(num_reserved) - reservation.num_tokens, retry_in_s
        )
        logger.info("request over its tenant's tokens per minute", request_id=request_id)
        return self._session.on_submit_refused(request_id, "queue_full", message)

    async def _load_tenants(self, stop: asyncio.Event) -> None:
        """The first tenant table; waits for Redis (until ``stop``) to read its hash."""
        failures = 0
        while True:
            try:
                await self._tenants.load()
                break
            except AuthenticationError:
                raise  # a wrong password stays wrong: no retry helps
            except (RedisError, OSError) as error:
                logger.warning("cannot read the tenants hash yet", error=str(error))
            try:
                async with asyncio.timeout(reconnect_backoff_s(failures)):
                    await stop.wait()
                return
            except TimeoutError:
                failures += 1
        if self._tenants.table.num_keys == 0 and not self._open_allowed:
            raise UnprotectedHostError(
                f"no API keys are configured (tenants file: {self.settings.tenants_file}, "
                f"Redis hash: {self._keys.tenants}), so the gateway would be open to anyone "
                f"on {self.settings.host}; add keys, or listen on 127.0.0.1"
            )

    async def _watch_tenants(self) -> None:
        """Re-read the tenants every ``tenants_reload_s`` (the file only when it
        changed), and at once when asked (SIGHUP), until shutdown."""
        while not self._readers_stop.is_set():
            try:
                async with asyncio.timeout(self.settings.tenants_reload_s):
                    await _wait_any(self._tenants_reload, self._readers_stop)
            except TimeoutError:
                pass
            if self._readers_stop.is_set():
                return
            forced = self._tenants_reload.is_set()
            self._tenants_reload.clear()
            await self._tenants.reload(force_file=forced)

    async def _dead_letter(self, action: DeadLetter) -> None:
        try:
            await self._redis.xadd(
                self._keys.dead,
                {"source": action.source, "error": action.error, "data": action.data},
                maxlen=DEAD_STREAM_MAX_LEN,
                approximate=True,
            )
        except (RedisError, OSError) as error:
            logger.error("could not write to the dead stream", error=str(error))

    async def _sleep_unless_stopping(self, delay_s: float) -> None:
        try:
            async with asyncio.timeout(delay_s):
                await self._readers_stop.wait()
        except TimeoutError:
            pass


async def _write_frames(connection: ServerConnection, outbox: asyncio.Queue[str | None]) -> None:
    """Send one socket's frames in order until its reader says it is closed."""
    while (frame := await outbox.get()) is not None:
        try:
            await connection.send(frame)
        except ConnectionClosed:
            return


def _offered_subprotocols(request: Request) -> list[Subprotocol]:
    """The subprotocols a handshake offers (none when the header is malformed)."""
    offered: list[Subprotocol] = []
    for value in request.headers.get_all("Sec-WebSocket-Protocol"):
        try:
            offered += parse_subprotocol(value)
        except InvalidHeader:
            return []
    return offered


def _select_subprotocol(
    connection: ServerConnection, offered: Sequence[Subprotocol]
) -> Subprotocol | None:
    """``orcapod`` when offered: a browser that sent its key as ``bearer.<key>``
    needs one subprotocol selected, and never the one that holds the key."""
    return Subprotocol(SUBPROTOCOL) if SUBPROTOCOL in offered else None


async def _wait_any(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with asyncio.TaskGroup() as tasks:
        waits = [tasks.create_task(event.wait()) for event in events]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
