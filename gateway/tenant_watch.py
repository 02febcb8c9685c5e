"""The tenant table as one gateway holds it while it runs: the first load
(waiting for Redis) and the one decision whether keyless clients are served,
the reloads (every ``tenants_reload_s``, and at once on SIGHUP), and who a
request or handshake is by it (``gateway/handshake.py`` decides). The table
itself is ``gateway/tenant_loader.py``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection

import redis.asyncio as aioredis
import structlog
from aiohttp import web
from redis.exceptions import AuthenticationError, RedisError
from websockets.datastructures import Headers

from gateway.handshake import Admitted, HandshakeRefused, decide
from gateway.tenant_loader import TenantLoader
from gateway.tenants import OPEN_TENANT, Tenant, UnprotectedHostError, is_loopback_host
from shared.heartbeat import sleep_unless_set, wait_any
from shared.redis_streams import reconnect_backoff_s
from shared.settings import GatewaySettings

logger = structlog.get_logger(__name__)


class TenantWatch:
    """One gateway's tenants: loaded, watched, and asked who a request is."""

    def __init__(self, settings: GatewaySettings, redis: aioredis.Redis, hash_name: str) -> None:
        self._settings = settings
        self._hash_name = hash_name
        self._loader = TenantLoader(settings.tenants_file, redis, hash_name)
        self._reload = asyncio.Event()
        # Decided once, at start (``load``): keys that go away later never
        # open the gateway.
        self._open_tenant: Tenant | None = None

    @property
    def serves_keyless(self) -> bool:
        """Keyless clients are served, as the open tenant."""
        return self._open_tenant is not None

    def request_reload(self) -> None:
        """Re-read the tenants file and hash now (SIGHUP), not at the next poll."""
        self._reload.set()

    def admit(self, request: web.Request) -> Admitted:
        """Who a request or handshake is; raises HandshakeRefused (400, 401, 403)."""
        try:
            return decide(
                Headers(list(request.headers.items())),
                self._loader.table,
                open_tenant=self._open_tenant,
                allowed_origins=self._settings.allowed_origins,
            )
        except HandshakeRefused as refused:
            logger.info("request_refused", status=int(refused.status), reason=refused.body.strip())
            raise

    async def load(self, stop: asyncio.Event) -> bool:
        """The first tenant table (waits for Redis, until ``stop``: then False),
        and the one decision whether keyless clients are served. Raises
        TenantConfigError for a broken tenants file, and UnprotectedHostError
        for a gateway beyond loopback without any API key."""
        failures = 0
        while True:
            try:
                await self._loader.load()
                break
            except AuthenticationError:
                raise  # a wrong password stays wrong: no retry helps
            except (RedisError, OSError) as error:
                logger.warning("tenants_hash_unreachable", error=str(error))
            await sleep_unless_set(stop, reconnect_backoff_s(failures))
            if stop.is_set():
                return False
            failures += 1
        settings = self._settings
        num_keys = self._loader.table.num_keys
        if settings.open or (num_keys == 0 and is_loopback_host(settings.host)):
            self._open_tenant = OPEN_TENANT
            logger.info("open_tenant_served", num_keys=num_keys)
        elif num_keys == 0:
            raise UnprotectedHostError(
                f"no API keys are configured (tenants file: {settings.tenants_file}, "
                f"Redis hash: {self._hash_name}), so the gateway would be open to anyone "
                f"on {settings.host}; add keys, listen on 127.0.0.1, or pass --open"
            )
        return True

    async def watch_until(
        self, stop: asyncio.Event, on_change: Callable[[Collection[str]], Awaitable[None]]
    ) -> None:
        """Re-read the tenants every ``tenants_reload_s`` (the file only when it
        changed), and at once when asked (SIGHUP), until ``stop``; after a
        change, ``on_change`` gets the hashes of the keys now valid."""
        while not stop.is_set():
            try:
                async with asyncio.timeout(self._settings.tenants_reload_s):
                    await wait_any(self._reload, stop)
            except TimeoutError:
                pass
            if stop.is_set():
                return
            forced = self._reload.is_set()
            self._reload.clear()
            if await self._loader.reload(force_file=forced):
                await on_change(self._loader.table.by_hash.keys())
