"""The scheduler's live view as this gateway last read it, for its dashboards.

One GET of ``RedisKeys.live_stats`` every ``PUBLISH_INTERVAL_S``, and only
while at least one dashboard socket watches; each socket's writer waits for
the next version and sends the latest, so a slow viewer skips snapshots
instead of queueing them (at most one frame in flight per socket).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import msgspec
import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.heartbeat import sleep_unless_set, wait_any
from shared.live_stats import PUBLISH_INTERVAL_S, LiveSnapshot, decode_snapshot

logger = structlog.get_logger(__name__)


class LiveFeed:
    """The latest snapshot (None: none is published) and its version."""

    def __init__(self, redis: Redis, key: str, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        self._redis = redis
        self._key = key
        self._interval_s = interval_s
        self.latest: LiveSnapshot | None = None
        self.version = 0
        self._raw: bytes | None = None
        self._changed = asyncio.Condition()
        self._num_watchers = 0
        self._watched = asyncio.Event()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """While inside, the feed reads Redis."""
        self._num_watchers += 1
        self._watched.set()
        try:
            yield
        finally:
            self._num_watchers -= 1
            if self._num_watchers == 0:
                self._watched.clear()

    async def next(self, after_version: int) -> tuple[int, LiveSnapshot | None]:
        """The first version other than ``after_version``, and its snapshot."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != after_version)
            return self.version, self.latest

    async def poll_until(self, stop: asyncio.Event) -> None:
        """Read the key while watched, until ``stop``."""
        while not stop.is_set():
            if not self._watched.is_set():
                await wait_any(self._watched, stop)
                continue
            await self._read()
            await sleep_unless_set(stop, self._interval_s)

    async def _read(self) -> None:
        try:
            raw: bytes | None = await self._redis.get(self._key)  # type: ignore[assignment]
        except (RedisError, OSError) as error:
            logger.warning("live_view_unreadable", error=str(error))
            raw = None
        if raw is not None and raw == self._raw:
            return
        snapshot: LiveSnapshot | None = None
        if raw is not None:
            try:
                snapshot = decode_snapshot(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                logger.warning("undecodable_live_view", error=str(error))
        if snapshot is None and self.latest is None and self.version > 0:
            return  # still nothing to show: nothing new to say
        self._raw = raw
        async with self._changed:
            self.latest = snapshot
            self.version += 1
            self._changed.notify_all()
