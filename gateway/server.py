"""The gateway actor: its parts, its tasks and the order they start and stop
in (the drain). The routes are ``gateway/routes.py``'s, the sockets'
lifecycles ``gateway/sockets.py``'s, the core's actions
``gateway/dispatcher.py``'s, the tenants ``gateway/tenant_watch.py``'s; see
``docs/architecture.md`` (*Gateway*).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection

import structlog
from aiohttp import web
from redis.exceptions import RedisError

from gateway.admission import AdmissionLimits
from gateway.connection_guard import ConnectionLimits
from gateway.connections import Connections
from gateway.dispatcher import Dispatcher
from gateway.guarded_site import GuardedSite
from gateway.host_guard import host_guard, own_names
from gateway.live_feed import LiveFeed
from gateway.metrics import GatewayMetrics
from gateway.openai_endpoint import OpenAIEndpoint
from gateway.openai_errors import shutting_down
from gateway.routes import WS_PATH, build_app, health_check
from gateway.session import GatewaySession, SessionConfig
from gateway.sockets import SocketHandlers
from gateway.tenant_watch import TenantWatch
from gateway.token_channel import TokenChannel
from gateway.tokenize_queue import TokenizeQueueLimits
from gateway.tokenizer import ChatTokenizer
from gateway.tokenizer_pool import TokenizerPool
from gateway.validation import ModelLimits
from shared.heartbeat import heartbeat_ttl_ms, sleep_unless_set, wait_any
from shared.keys import RedisKeys
from shared.redis_streams import connect
from shared.settings import GatewaySettings, served_model_name

logger = structlog.get_logger(__name__)

# After the drain, how long the HTTP server waits for its handlers before cancelling them.
SHUTDOWN_TIMEOUT_S = 1.0
DRAIN_POLL_S = 0.05
REDIS_TIMEOUT_S = 5.0


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
        self._session = GatewaySession(_session_config(settings), tokenizer, limits, clock)
        self._redis = connect(settings.redis.url, socket_timeout_s=REDIS_TIMEOUT_S)
        self._tenants = TenantWatch(settings, self._redis, self._keys.tenants)
        self._connections = Connections()
        self._live = LiveFeed(self._redis, self._keys.live_stats)
        served_model = served_model_name(settings.model.model_dir)
        self.metrics = GatewayMetrics(settings.gateway_id, served_model)
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
        channel = self._keys.tokens(settings.gateway_id)
        self._dispatcher = Dispatcher(
            self._session,
            self._connections,
            self.metrics,
            self._pool,
            self._redis,
            self._keys,
            settings.redis.log_retention_s,
            channel,
        )
        self._readers_stop = asyncio.Event()
        self._channel = TokenChannel(
            self._redis,
            channel,
            self._dispatcher.on_gateway_message,
            lambda: self._dispatcher.logs.catch_up(self._readers_stop),
        )
        self._openai = OpenAIEndpoint(
            admit=self._tenants.admit,
            open_exchange=self._dispatcher.exchange,
            served_model=served_model,
            context_tokens=limits.context_tokens,
            max_body_bytes=settings.max_frame_bytes,
            max_outbox_bytes=settings.max_outbox_bytes,
            count_error=self.metrics.count_error,
            on_started=self.metrics.http_request_started,
            on_ended=self.metrics.http_request_ended,
        )
        self._sockets = SocketHandlers(
            admit=self._tenants.admit,
            draining=lambda: self._session.draining,
            dispatcher=self._dispatcher,
            connections=self._connections,
            metrics=self.metrics,
            live=self._live,
            max_frame_bytes=settings.max_frame_bytes,
            max_outbox_bytes=settings.max_outbox_bytes,
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
        self._tenants.request_reload()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down in order. Raises
        TenantConfigError for a broken tenants file, and UnprotectedHostError
        when asked to listen beyond loopback without any API key."""
        readers_stop = self._readers_stop
        try:
            if not await self._tenants.load(stop):
                return
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._channel.read_until(readers_stop), name="tokens")
                tasks.create_task(self._heartbeat(), name="gateway-heartbeat")
                tasks.create_task(
                    self._tenants.watch_until(readers_stop, self._close_revoked),
                    name="gateway-tenants",
                )
                tasks.create_task(
                    self._dispatcher.logs.follow_until(readers_stop), name="gateway-logs"
                )
                tasks.create_task(self._live.poll_until(readers_stop), name="gateway-live")
                try:
                    # Serve only once tokens can reach us: a request accepted
                    # before the SUBSCRIBE is in place could lose its first tokens.
                    await wait_any(self._channel.subscribed, stop)
                    if not stop.is_set():
                        await self._serve(stop)
                finally:
                    readers_stop.set()
        finally:
            self._pool.close()
            await self._redis.aclose()
            logger.info("gateway_stopped")

    async def _serve(self, stop: asyncio.Event) -> None:
        settings = self.settings
        app = build_app(
            max_body_bytes=settings.max_frame_bytes,
            host_guard=host_guard(
                lambda: self._tenants.serves_keyless,
                own_names(settings.host),
                settings.allowed_hosts,
            ),
            sockets=self._sockets,
            openai=self._openai,
            health=health_check(self._redis, self._keys.ready),
            metrics_registry=self.metrics.registry,
        )
        # handler_cancellation: a client that goes away cancels its handler at
        # once, and with it its request. The connections' own settings (no
        # access log, the guard's timeouts) are the site's.
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
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
                "gateway_listening",
                url=self.url,
                openai_base_url=f"{self.http_url}/v1",
                gateway_id=settings.gateway_id,
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
            "gateway_draining",
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
        self._connections.end_exchanges(shutting_down)
        deadline_s = loop.time() + SHUTDOWN_TIMEOUT_S
        while self._connections.has_unsent_frames and loop.time() < deadline_s:
            await asyncio.sleep(DRAIN_POLL_S)
        # A writer that just took the last frame from its outbox sends it now.
        await asyncio.sleep(0)
        logger.info(
            "gateway_shutting_down",
            num_sockets=self._session.num_sockets,
            num_unfinished=self._session.num_live_requests,
        )
        await self._connections.close_all()

    def _has_unsent_work(self) -> bool:
        """Requests in flight, or frames not yet handed to their connection."""
        return self._session.num_live_requests > 0 or self._connections.has_unsent_frames

    async def _close_revoked(self, valid: Collection[str]) -> None:
        """Close the connections of keys no longer ``valid`` (sha256 hashes)."""
        revoked = self._session.table.sockets_without_key(valid)
        if revoked:
            logger.info("revoked_sockets_closing", num_sockets=len(revoked))
        await self._connections.close_revoked(revoked, valid)

    async def _heartbeat(self) -> None:
        """Keep this gateway's heartbeat key alive until shutdown, and let the
        session's clock tick."""
        key = self._keys.gateway_heartbeat(self.settings.gateway_id)
        ttl_ms = heartbeat_ttl_ms(self.settings.heartbeat_s)
        while not self._readers_stop.is_set():
            try:
                await self._redis.set(key, self.settings.gateway_id, px=ttl_ms)
            except (RedisError, OSError) as error:
                logger.warning("heartbeat_failed", error=str(error))
            await self._dispatcher.on_tick()
            await sleep_unless_set(self._readers_stop, self.settings.heartbeat_s)
        try:
            await self._redis.delete(key)
        except (RedisError, OSError) as error:
            logger.warning("heartbeat_key_not_removed", error=str(error))


def _session_config(settings: GatewaySettings) -> SessionConfig:
    """The core's knobs, from the gateway's settings."""
    return SessionConfig(
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
    )
