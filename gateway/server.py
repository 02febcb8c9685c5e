"""The gateway actor: the asyncio shell around :class:`gateway.session.GatewaySession`.

It owns the I/O and nothing else: a websockets server (``/ws``, ``/healthz``),
one redis.asyncio client, one pub/sub reader for the gateway's tokens
channel, one heartbeat, and per socket one reader and one writer. Every task
is owned by a TaskGroup and awaited. Shutdown, when ``stop`` is set, is
ordered: stop accepting and close every socket (which cancels their requests
upstream), then stop the reader and the heartbeat, then close Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from http import HTTPStatus
from urllib.parse import urlsplit

import structlog
from redis.exceptions import RedisError
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from gateway.actions import Action, DeadLetter, PostUpstream, SendFrame
from gateway.session import GatewaySession, SessionConfig
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import SubmitRequest, encode
from shared.protocol import Error, encode_json
from shared.redis_streams import connect
from shared.settings import GatewaySettings

logger = structlog.get_logger(__name__)

WS_PATH = "/ws"
HEALTH_PATH = "/healthz"
# websockets' own limit, far above ours: an oversized frame still arrives, so
# the client gets an `error` it can act on instead of a closed socket.
LIBRARY_MAX_SIZE_FACTOR = 16
POLL_S = 0.5
HEALTH_TIMEOUT_S = 1.0
REDIS_TIMEOUT_S = 5.0
RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
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
            ),
            tokenizer,
            limits,
            clock,
        )
        self._redis = connect(settings.redis.url, socket_timeout_s=REDIS_TIMEOUT_S)
        # Frames for each open socket, sent by that socket's writer task, so a
        # slow client never stalls the pub/sub reader that feeds everyone. Not
        # bounded here: a socket's frames are bounded by its in-flight limit
        # times max_tokens, and keepalive pings drop dead peers.
        self._outboxes: dict[int, asyncio.Queue[str | None]] = {}
        self._readers_stop = asyncio.Event()
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

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down in order."""
        subscribed = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._read_tokens(subscribed), name="gateway-tokens")
                tasks.create_task(self._heartbeat(), name="gateway-heartbeat")
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
            max_size=LIBRARY_MAX_SIZE_FACTOR * self.settings.max_frame_bytes,
        ) as server:
            self.port = int(next(iter(server.sockets)).getsockname()[1])
            logger.info("gateway listening", url=self.url, gateway_id=self.settings.gateway_id)
            self.listening.set()
            await stop.wait()
            logger.info("gateway shutting down", num_sockets=self._session.num_sockets)
        # Leaving `serve` closed every socket and awaited its handler, so every
        # live request has been cancelled upstream by now.

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
        socket_id = self._session.connect()
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
                except (RedisError, OSError) as error:
                    # redis-py reconnects and subscribes again on the next call;
                    # what was published meanwhile is lost (pub/sub keeps nothing).
                    logger.warning("tokens channel unreachable", error=str(error))
                    await self._sleep_unless_stopping(_backoff_s(failures))
                    failures += 1
                    continue
                failures = 0
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    logger.info("subscribed", channel=channel)
                    subscribed.set()
                elif message["type"] == "message":
                    await self._apply(self._on_gateway_message(message["data"], channel))
        finally:
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
        """Keep this gateway's heartbeat key alive (TTL a few beats) until shutdown."""
        key = self._keys.gateway_heartbeat(self.settings.gateway_id)
        ttl_ms = max(int(3_000 * self.settings.heartbeat_s), 1_000)
        while not self._readers_stop.is_set():
            try:
                await self._redis.set(key, self.settings.gateway_id, px=ttl_ms)
            except (RedisError, OSError) as error:
                logger.warning("heartbeat failed", error=str(error))
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

    async def _post_upstream(self, action: PostUpstream) -> None:
        message = action.message
        is_submit = isinstance(message, SubmitRequest)
        stream = self._keys.requests if is_submit else self._keys.control
        try:
            await self._redis.xadd(stream, {MESSAGE_FIELD: encode(message)})
        except (RedisError, OSError) as error:
            logger.error(
                "could not post upstream",
                request_id=message.request_id,
                stream=stream,
                error=str(error),
            )
            if is_submit:
                await self._apply(self._session.on_submit_failed(message.request_id, str(error)))

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


async def _wait_any(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with asyncio.TaskGroup() as tasks:
        waits = [tasks.create_task(event.wait()) for event in events]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()


def _backoff_s(failures: int) -> float:
    return RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
