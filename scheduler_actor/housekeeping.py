"""The scheduler's checks once a second, and the ready key.

Whether Redis is still the same server process (its ``run_id``); which
workers are silent longer than ``worker_timeout_s`` (lost) and which gateways
longer than ``orphan_timeout_s`` (their requests nobody resumed elsewhere are
cancelled); ``ready`` refreshed while a worker is registered. The actor reads
the heartbeat keys here; ``liveness.py`` decides. See docs/architecture.md.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from scheduler_actor.core import Scheduler
from scheduler_actor.event_handler import EventHandler
from scheduler_actor.liveness import Liveness
from shared.keys import RedisKeys
from shared.settings import SchedulerSettings

HOUSEKEEPING_S = 1.0
READY_TTL_S = 3


class RedisRestartedError(Exception):
    """Redis answers as a new server process: what it lost is unknown, so the
    scheduler starts a new incarnation from what Redis holds now."""


class Housekeeping:
    """Heartbeats of workers and gateways, Redis's identity and the ready key."""

    def __init__(self, redis: aioredis.Redis, settings: SchedulerSettings) -> None:
        self._redis = redis
        self._keys = RedisKeys(settings.redis.prefix)
        # The event handler records joins and losses here.
        self.workers_alive = Liveness(settings.worker_timeout_s)
        self._gateways_alive = Liveness(settings.orphan_timeout_s)
        self._next_check_s = 0.0
        self._redis_run_id = ""

    async def start(self) -> None:
        """A new incarnation: forget who was seen when, note which Redis this is."""
        self.workers_alive.clear()
        self._gateways_alive.clear()
        self._redis_run_id = await self._server_run_id()

    async def check_if_due(self, now: float, handler: EventHandler, pipe: Pipeline) -> bool:
        """Once every ``HOUSEKEEPING_S``: raise RedisRestartedError if Redis is a
        new server, lose silent workers, cancel orphans, checkpoint and trim the
        journal (on ``pipe``).
        True when it ran (the ready key is then refreshed)."""
        if now < self._next_check_s:
            return False
        self._next_check_s = now + HOUSEKEEPING_S
        if await self._server_run_id() != self._redis_run_id:
            raise RedisRestartedError
        await self._check_heartbeats(now, handler, pipe)
        handler.trim_journal(pipe)
        return True

    def refresh_ready(self, core: Scheduler, pipe: Pipeline) -> None:
        """``ready`` exists while a worker is registered (gateways' ``/healthz``)."""
        if core.workers:
            pipe.set(self._keys.ready, b"1", ex=READY_TTL_S)
        else:
            pipe.delete(self._keys.ready)

    async def _server_run_id(self) -> str:
        """The Redis server process's run id: a new one means Redis restarted."""
        info = await self._redis.info("server")
        return str(info.get("run_id", ""))

    async def _check_heartbeats(
        self, now: float, handler: EventHandler, turn_pipe: Pipeline
    ) -> None:
        """Lose silent workers; cancel the requests of gateways silent for
        ``orphan_timeout_s`` (nobody resumed them elsewhere meanwhile)."""
        core = handler.core
        worker_ids = list(core.workers)
        gateway_ids = sorted(
            {request.gateway_id for request in core.requests.values() if request.gateway_id}
        )
        if not worker_ids and not gateway_ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.exists(self._keys.worker_heartbeat(worker_id))
        for gateway_id in gateway_ids:
            pipe.exists(self._keys.gateway_heartbeat(gateway_id))
        alive = await pipe.execute()
        for worker_id, is_alive in zip(worker_ids, alive, strict=False):
            if self.workers_alive.is_gone(worker_id, bool(is_alive), now):
                handler.lose(worker_id, "heartbeat_timeout", turn_pipe)
        for gateway_id, is_alive in zip(gateway_ids, alive[len(worker_ids) :], strict=True):
            if self._gateways_alive.is_gone(gateway_id, bool(is_alive), now):
                self._gateways_alive.forget(gateway_id)
                handler.cancel_orphans(gateway_id, turn_pipe)
