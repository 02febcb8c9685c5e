"""An actor whose Redis is gone for good stops by itself.

Every loop of an actor retries Redis with a backoff (``reconnect_backoff_s``)
and rightly so: a restart of Redis, a network blip, a failover last seconds.
But an actor left behind by a service that was torn down (its Redis removed
with it) would retry forever, holding its memory. ``watch_redis`` runs beside
the actor's main (``run_actor``) and PINGs Redis on a connection of its own
once a second; when no PING has been answered for ``limit_s`` it logs
``redis_gone_for_good`` and raises ``RedisGoneError``, which ends the actor
with exit status 3. A supervisor that restarts actors (``orcapod up``, compose
with ``restart: unless-stopped``) starts it again, retrying from scratch.

Any answer counts, an error reply too (a Redis loading its data, refusing a
login): only an unreachable server is an outage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.redis_streams import connect

PROBE_INTERVAL_S = 1.0
EXIT_REDIS_GONE = 3

_log = structlog.get_logger(__name__)


class RedisGoneError(Exception):
    """Redis answered nothing for longer than the actor's outage limit."""


class OutageClock:
    """How long Redis has been unreachable, from the probes' outcomes (pure)."""

    __slots__ = ("_limit_s", "_since_s")

    def __init__(self, limit_s: float) -> None:
        if not limit_s > 0:
            raise ValueError(f"the Redis outage limit must be positive, got {limit_s}")
        self._limit_s = limit_s
        self._since_s: float | None = None

    def answered(self) -> None:
        self._since_s = None

    def unanswered(self, now_s: float) -> bool:
        """A probe went unanswered at ``now_s``; True once the outage passed the limit."""
        if self._since_s is None:
            self._since_s = now_s
        return now_s - self._since_s >= self._limit_s

    def outage_s(self, now_s: float) -> float:
        return 0.0 if self._since_s is None else now_s - self._since_s


async def watch_redis(
    url: str, limit_s: float, clock: Callable[[], float] = time.monotonic
) -> None:
    """PING ``url`` every second until cancelled; raises ``RedisGoneError`` once
    no PING has been answered for ``limit_s`` seconds."""
    outage = OutageClock(limit_s)
    redis = connect(url, max_connections=1, socket_timeout_s=PROBE_INTERVAL_S)
    try:
        while True:
            try:
                await redis.ping()
                outage.answered()
            except (TimeoutError, RedisConnectionError, RedisTimeoutError, OSError):
                now_s = clock()
                if outage.unanswered(now_s):
                    _log.error(
                        "redis_gone_for_good",
                        outage_s=round(outage.outage_s(now_s), 1),
                        limit_s=limit_s,
                        hint="the actor stops; --redis-outage-limit-s 0 retries forever",
                    )
                    raise RedisGoneError(
                        f"Redis has not answered for {outage.outage_s(now_s):.0f} s "
                        f"(the limit is {limit_s:g} s, --redis-outage-limit-s)"
                    ) from None
            except RedisError:
                outage.answered()  # it answered, with an error: it is there
            await asyncio.sleep(PROBE_INTERVAL_S)
    finally:
        await redis.aclose()


async def stopping_when_redis_gone(
    main: Coroutine[Any, Any, None], url: str, limit_s: float
) -> None:
    """Await ``main`` with ``watch_redis`` beside it (``limit_s`` 0: no watch).

    ``main``'s own end, or its exception, passes through unchanged (not in an
    exception group: callers catch what the actor raises); when the watch
    gives up, ``main`` is cancelled and ``RedisGoneError`` raised."""
    if limit_s == 0:
        await main
        return
    actor = asyncio.ensure_future(main)
    watch = asyncio.create_task(watch_redis(url, limit_s))
    try:
        await asyncio.wait((actor, watch), return_when=asyncio.FIRST_COMPLETED)
        if not actor.done():
            actor.cancel()
            await asyncio.gather(actor, return_exceptions=True)
            watch.result()  # it ends only by raising
        actor.result()
    finally:
        for task in (actor, watch):
            task.cancel()
        await asyncio.gather(actor, watch, return_exceptions=True)
