"""The scheduler actor: the asyncio shell that moves messages between Redis and the core.

It owns the turn loop (``turn``: one XREADGROUP over results, control and
requests; every message applied; every plan the core yields XADDed; one
MULTI/EXEC; the read and the transaction on a held connection,
``shared/redis_lane.py``) and starts each incarnation (``start``; a new one after Redis
failed or restarted). What each message does is ``event_handler.py``; what a
new incarnation takes back from Redis, ``recovery.py``; the checks once a
second and the ready key, ``housekeeping.py``. Metrics (``metrics.py``) read
the core when scraped; the live view (``live_view.py``) records each plan and
result; ``step_timing.py`` sums where each step's time went. See
docs/architecture.md (The actors: Scheduler).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline
from redis.exceptions import AuthenticationError, RedisError

from scheduler_actor.block_ledger import PrefixCacheStats
from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.event_handler import EventHandler, SchedulerCounters, queue_ack
from scheduler_actor.housekeeping import Housekeeping, RedisRestartedError
from scheduler_actor.live_view import LiveView
from scheduler_actor.metrics import SchedulerMetrics
from scheduler_actor.recovery import recover, take_epoch
from scheduler_actor.step_timing import StepTimingTotals
from shared.hash_counters import queue_increments
from shared.heartbeat import sleep_unless_set
from shared.keys import SCHEDULER_GROUP, RedisKeys
from shared.live_stats import PUBLISH_INTERVAL_S, TTL_MS, encode_snapshot
from shared.messages import StepOutput, StepPlan, decode_control_message, decode_step_output
from shared.redis_lane import RedisLane
from shared.redis_streams import (
    PLAN_STREAM_MAXLEN,
    ensure_group,
    read_group,
    reconnect_backoff_s,
    xadd_message,
)
from shared.settings import SchedulerSettings

READ_BLOCK_MS = 100
READ_COUNT = 1024
SUMMARY_EVERY_S = 10.0
# How often the step-timing sums go to the stats hash.
TIMING_FLUSH_S = 0.25
CONSUMER_NAME = "scheduler"

_log = structlog.get_logger(__name__)


def scheduler_config(settings: SchedulerSettings, epoch: int) -> SchedulerConfig:
    """The core's configuration from the actor's settings."""
    return SchedulerConfig(
        policy=PolicyName(settings.policy),
        max_batch_size=settings.max_batch_size,
        token_budget=settings.token_budget,
        max_chunk_tokens=settings.max_chunk_tokens,
        pipeline_token_budget=settings.pipeline_token_budget,
        max_waiting=settings.max_waiting,
        epoch=epoch,
        prefix_caching=settings.prefix_caching,
        cache_aware_routing=settings.cache_aware_routing,
        routing_slack=settings.routing_slack,
    )


class SchedulerActor:
    """Feeds Redis messages to a core ``Scheduler`` and sends its plans."""

    def __init__(
        self,
        settings: SchedulerSettings,
        redis: aioredis.Redis,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.keys = RedisKeys(settings.redis.prefix)
        self._redis = redis
        # The turn's read and transaction, once per step: on a held connection.
        self._lane = RedisLane(redis)
        self._clock = clock
        self._handler: EventHandler | None = None
        self._housekeeping = Housekeeping(redis, settings)
        self._next_summary_s = 0.0
        self._next_publish_s = 0.0
        self._counters = SchedulerCounters()
        # Served at /metrics by the process (``__main__``) when asked to.
        self.metrics = SchedulerMetrics(settings.model_name)
        self._live = LiveView()
        self._timing = StepTimingTotals()
        self._prefix_cache_sent = PrefixCacheStats()  # the counts the hash has of this core
        self._next_timing_flush_s = 0.0
        self._epoch = 0
        self._decoders = {
            # Results first: they free capacity the other events may use.
            self.keys.results: decode_step_output,
            self.keys.control: decode_control_message,
            self.keys.requests: decode_control_message,
        }

    @property
    def core(self) -> Scheduler:
        """The core (after ``start``)."""
        return self.handler.core

    @property
    def handler(self) -> EventHandler:
        """The event handler of the current incarnation (after ``start``)."""
        assert self._handler is not None, "start() first"
        return self._handler

    async def start(self) -> None:
        """Take a new epoch, make sure the consumer groups exist and recover
        every request an earlier incarnation left unfinished."""
        epoch = self._epoch = await take_epoch(self._redis, self.keys, self._epoch)
        core = Scheduler(scheduler_config(self.settings, epoch), self._clock)
        self.metrics.watch(core)
        # Step indices start again with the new core, and its cache counts from 0.
        self._live = LiveView()
        self._prefix_cache_sent = PrefixCacheStats()
        self._handler = EventHandler(
            core,
            self._redis,
            self.settings,
            self._counters,
            self._live,
            self._housekeeping.workers_alive,
            self._clock,
            self.metrics,
        )
        # "0": a worker may have joined, or a gateway submitted, before we started.
        for stream in self._decoders:
            await ensure_group(self._redis, stream, SCHEDULER_GROUP, start_id="0")
        await self._housekeeping.start()
        num_recovered = await recover(self._redis, self.keys, CONSUMER_NAME, self._handler)
        _log.info(
            "scheduler_started",
            epoch=epoch,
            policy=self.settings.policy,
            num_recovered=num_recovered,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Start, then turn until ``stop`` is set; the ready key goes with us.

        When Redis fails for longer than the client's retries, or restarts,
        the scheduler starts again (a new incarnation) once Redis answers.
        """
        failures = 0
        try:
            while not stop.is_set():
                try:
                    await self.start()
                    while not stop.is_set():
                        await self.turn()
                        # Only a turn that went through resets the backoff: a Redis
                        # that lets start() through and refuses every write (OOM)
                        # must not restart an incarnation ten times a second.
                        failures = 0
                except AuthenticationError:
                    raise  # a wrong password stays wrong: no retry helps
                except RedisRestartedError:
                    _log.warning("redis_restarted", epoch=self._epoch)
                except (RedisError, OSError) as error:
                    _log.warning("redis_unreachable", error=str(error), failures=failures)
                    await sleep_unless_set(stop, reconnect_backoff_s(failures))
                    failures += 1
        finally:
            with contextlib.suppress(RedisError, OSError):
                await self._redis.delete(self.keys.ready, self.keys.live_stats)
            await self._lane.close()
            _log.info("scheduler_stopped", **vars(self._counters))

    async def turn(self) -> None:
        """Read, apply, plan, send and acknowledge once."""
        entries = await read_group(
            self._redis,
            SCHEDULER_GROUP,
            CONSUMER_NAME,
            self._decoders,
            self.keys.dead,
            block_ms=READ_BLOCK_MS,
            count=READ_COUNT,
            lane=self._lane,
        )
        read_at = time.time()
        work_started = time.perf_counter()
        # One transaction: the plans, rejections and acknowledgements of a turn
        # reach Redis together or not at all.
        pipe = self._redis.pipeline(transaction=True)
        handler = self.handler
        membership_changed = False
        for entry in entries:
            if isinstance(entry.message, StepOutput) and entry.message.timing is not None:
                self._timing.add_step(entry.message.timing, read_at)
            membership_changed |= await handler.apply(entry, pipe)
        now = self._clock()
        membership_changed |= await self._housekeeping.check_if_due(now, handler, pipe)
        if membership_changed:
            self._housekeeping.refresh_ready(self.core, pipe)
        plans = self._queue_plans(pipe)
        if now >= self._next_publish_s:
            self._next_publish_s = now + PUBLISH_INTERVAL_S
            self._publish_live_view(pipe)
        for entry in entries:
            # A request's submit stays pending until the request ends.
            if entry.stream != self.keys.requests:
                queue_ack(pipe, self.keys, entry.stream, entry.entry_id)
        cache_counts: PrefixCacheStats | None = None
        if len(pipe):
            if now >= self._next_timing_flush_s:
                # A few times a second: the sums are for benchmarks, not per turn.
                self._next_timing_flush_s = now + TIMING_FLUSH_S
                self._timing.queue_flush(pipe, self.keys.step_timing)
                cache_counts = self._queue_prefix_cache_counts(pipe)
            work_s = time.perf_counter() - work_started
            await self._lane.execute(pipe)
            if cache_counts is not None:
                self._prefix_cache_sent = cache_counts
            self._timing.add_turn(work_s, time.perf_counter() - work_started - work_s)
        self.metrics.plans_sent(plans, self.core)
        if now >= self._next_summary_s and (entries or self.core.requests):
            # An idle service logs nothing: a summary only when there was work.
            self._next_summary_s = now + SUMMARY_EVERY_S
            _log.info(
                "scheduler_summary",
                num_workers=len(self.core.workers),
                num_live_requests=len(self.core.requests),
                num_waiting=self.core.num_waiting,
                **vars(self._counters),
            )

    def _queue_prefix_cache_counts(self, pipe: Pipeline) -> PrefixCacheStats:
        """Add what the prefix caches did since the last sent counts to their
        hash; returns the counts the hash has once ``pipe`` succeeds."""
        stats = self.core.prefix_cache_stats
        queue_increments(pipe, self.keys.prefix_cache, dict(stats.since(self._prefix_cache_sent)))
        return dataclasses.replace(stats)

    def _publish_live_view(self, pipe: Pipeline) -> None:
        """The dashboard's snapshot; it vanishes ``TTL_MS`` after the last write."""
        snapshot = self._live.snapshot(self.core, now_ms=int(time.time() * 1000))
        pipe.set(self.keys.live_stats, encode_snapshot(snapshot), px=TTL_MS)

    def _queue_plans(self, pipe: Pipeline) -> list[StepPlan]:
        """Every plan the core can send now, in order, per worker; returns them."""
        plans: list[StepPlan] = []
        for worker_id in self.core.workers:
            while (plan := self.core.next_plan(worker_id)) is not None:
                plan = msgspec.structs.replace(plan, planned_at=time.time())
                xadd_message(pipe, self.keys.plans(worker_id), plan, maxlen=PLAN_STREAM_MAXLEN)
                self._live.record_plan(plan)
                plans.append(plan)
        self._counters.num_plans += len(plans)
        return plans
