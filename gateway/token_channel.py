"""The gateway's one pub/sub reader: ``tokens:<gateway>`` (TokenBatch and
RequestRejected from workers and the scheduler), subscribed again on a fresh
connection after any failure.

A resubscription is reported (``on_resubscribed``) so the shell can read the
running requests' logs for what was published while the channel was down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import AuthenticationError, RedisError

from shared.heartbeat import sleep_unless_set
from shared.redis_streams import reconnect_backoff_s

logger = structlog.get_logger(__name__)

POLL_S = 0.5


class TokenChannel:
    """Reads one channel until ``stop``; every message goes to ``on_message``."""

    def __init__(
        self,
        redis: aioredis.Redis,
        channel: str,
        on_message: Callable[[bytes], Awaitable[None]],
        on_resubscribed: Callable[[], Awaitable[None]],
    ) -> None:
        self._redis = redis
        self.channel = channel
        self._on_message = on_message
        self._on_resubscribed = on_resubscribed
        self.subscribed = asyncio.Event()

    async def read_until(self, stop: asyncio.Event) -> None:
        """The reader task; ``subscribed`` is set once the first SUBSCRIBE holds."""
        pubsub = self._redis.pubsub()
        failures = 0
        # Our own flag: a SUBSCRIBE that failed to connect leaves redis-py's
        # `subscribed` true without a connection to read from.
        needs_subscribe = True
        try:
            while not stop.is_set():
                try:
                    if needs_subscribe:
                        await pubsub.subscribe(self.channel)
                        needs_subscribe = False
                    message = await pubsub.get_message(timeout=POLL_S)
                except AuthenticationError:
                    raise  # a wrong password stays wrong: no retry helps
                except (RedisError, OSError) as error:
                    # A fresh subscription on a fresh connection: redis-py's own
                    # reconnect of a broken pub/sub connection can keep failing
                    # long after Redis is back.
                    logger.warning("tokens_channel_unreachable", error=str(error))
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.aclose()
                    pubsub = self._redis.pubsub()
                    needs_subscribe = True
                    await sleep_unless_set(stop, reconnect_backoff_s(failures))
                    failures += 1
                    continue
                failures = 0
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    logger.info("tokens_channel_subscribed", channel=self.channel)
                    if self.subscribed.is_set():
                        await self._on_resubscribed()
                    self.subscribed.set()
                elif message["type"] == "message":
                    await self._on_message(message["data"])
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
