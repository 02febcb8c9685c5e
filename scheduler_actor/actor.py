"""The scheduler actor: the asyncio shell that moves messages between Redis and the core.

One loop owns the core. Each turn it reads whatever is new on the results,
control and requests streams (one XREADGROUP over the three, blocking at most
``READ_BLOCK_MS``), applies every message to the core as an event, asks the
core for every plan it can send now, and then, in one pipelined round trip,
XADDs the plans, publishes rejections and acknowledges the messages it
applied. Once a second it also checks worker heartbeats and refreshes the
ready key.

Overlap: workers join with ``max_inflight`` 2, so the core keeps a second
plan queued behind the one running. A result wakes the blocked XREADGROUP at
once and the plan that replaces it goes out in the same turn; a worker thus
finds its next plan already in its stream when a step ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    RequestTooLargeError,
    SchedulerError,
)
from shared.keys import SCHEDULER_GROUP, RedisKeys
from shared.messages import (
    CancelRequest,
    RequestRejected,
    StepOutput,
    SubmitRequest,
    WorkerJoined,
    WorkerLeft,
    decode_control_message,
    decode_step_output,
    encode,
)
from shared.redis_streams import StreamEntry, ensure_group, read_group, xadd_message
from shared.settings import SchedulerSettings

READ_BLOCK_MS = 100
READ_COUNT = 1024
HOUSEKEEPING_S = 1.0
READY_TTL_S = 3
# Plans are read within a step of being sent (at most max_inflight are unread),
# so keeping about this many bounds the stream without ever losing one.
PLAN_STREAM_MAXLEN = 1000
SUMMARY_EVERY_S = 10.0
CONSUMER_NAME = "scheduler"

Event = SubmitRequest | CancelRequest | WorkerJoined | WorkerLeft | StepOutput

_log = structlog.get_logger(__name__)


def scheduler_config(settings: SchedulerSettings, epoch: int) -> SchedulerConfig:
    """The core's configuration from the actor's settings."""
    return SchedulerConfig(
        policy=PolicyName(settings.policy),
        max_batch_size=settings.max_batch_size,
        token_budget=settings.token_budget,
        max_chunk_tokens=settings.max_chunk_tokens,
        epoch=epoch,
    )


@dataclass
class _Counters:
    num_plans: int = 0
    num_results: int = 0
    num_submitted: int = 0
    num_rejected: int = 0


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
        self._clock = clock
        self._core: Scheduler | None = None
        self._last_alive_s: dict[str, float] = {}
        self._next_housekeeping_s = 0.0
        self._next_summary_s = 0.0
        self._counters = _Counters()
        self._decoders = {
            # Results first: they free capacity the other events may use.
            self.keys.results: decode_step_output,
            self.keys.control: decode_control_message,
            self.keys.requests: decode_control_message,
        }

    @property
    def core(self) -> Scheduler:
        """The core (after ``start``)."""
        assert self._core is not None, "start() first"
        return self._core

    async def start(self) -> None:
        """Take a new epoch and make sure the consumer groups exist."""
        epoch = int(await self._redis.incr(self.keys.epoch))
        self._core = Scheduler(scheduler_config(self.settings, epoch), self._clock)
        # "0": a worker may have joined, or a gateway submitted, before we started.
        for stream in self._decoders:
            await ensure_group(self._redis, stream, SCHEDULER_GROUP, start_id="0")
        _log.info("scheduler_started", epoch=epoch, policy=self.settings.policy)

    async def run(self, stop: asyncio.Event) -> None:
        """Start, then turn until ``stop`` is set; the ready key goes with us."""
        await self.start()
        try:
            while not stop.is_set():
                await self.turn()
        finally:
            await self._redis.delete(self.keys.ready)
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
        )
        pipe = self._redis.pipeline(transaction=False)
        membership_changed = False
        for entry in entries:
            membership_changed |= await self._apply(entry, pipe)
        now = self._clock()
        if now >= self._next_housekeeping_s:
            self._next_housekeeping_s = now + HOUSEKEEPING_S
            await self._check_heartbeats(now)
            membership_changed = True
        if membership_changed:
            self._refresh_ready(pipe)
        self._queue_plans(pipe)
        for stream in self._decoders:
            entry_ids = [entry.entry_id for entry in entries if entry.stream == stream]
            if entry_ids:
                pipe.xack(stream, SCHEDULER_GROUP, *entry_ids)
        if len(pipe):
            await pipe.execute()
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

    async def _apply(self, entry: StreamEntry[Event], pipe: Pipeline) -> bool:
        """Apply one message to the core; True when the set of workers changed."""
        message = entry.message
        core = self.core
        if isinstance(message, StepOutput):
            self._counters.num_results += 1
            core.on_result(message)
        elif isinstance(message, SubmitRequest):
            self._submit(message, pipe)
        elif isinstance(message, CancelRequest):
            core.cancel(message.request_id)
        elif isinstance(message, WorkerJoined):
            return await self._join(message, pipe)
        elif isinstance(message, WorkerLeft) and message.worker_id in core.workers:
            self._lose(message.worker_id, reason="left")
            return True
        return False

    def _submit(self, message: SubmitRequest, pipe: Pipeline) -> None:
        self._counters.num_submitted += 1
        code: str | None = None
        reason = ""
        if self.core.num_waiting >= self.settings.max_waiting:
            code, reason = "queue_full", f"more than {self.settings.max_waiting} requests wait"
        else:
            try:
                self.core.submit(
                    message.request_id,
                    message.tenant,
                    message.prompt_ids,
                    message.sampling,
                    gateway_id=message.gateway_id,
                )
            except RequestTooLargeError as error:
                code, reason = "prompt_too_long", str(error)
            except (InvalidRequestError, DuplicateRequestError) as error:
                code, reason = "invalid_request", str(error)
        if code is not None:
            self._counters.num_rejected += 1
            _log.info("request_rejected", request_id=message.request_id, code=code, reason=reason)
            rejection = RequestRejected(request_id=message.request_id, code=code, message=reason)
            pipe.publish(self.keys.tokens(message.gateway_id), encode(rejection))

    async def _join(self, message: WorkerJoined, pipe: Pipeline) -> bool:
        worker_id = message.worker_id
        # A join read from the stream's history, of a worker long gone, is ignored.
        if not await self._redis.exists(self.keys.worker_heartbeat(worker_id)):
            _log.warning("join_of_dead_worker_ignored", worker_id=worker_id)
            return False
        if worker_id in self.core.workers:
            self._lose(worker_id, reason="rejoined")
        try:
            self.core.worker_joined(
                worker_id, message.num_blocks, message.block_size, message.max_inflight
            )
        except SchedulerError as error:
            _log.warning("bad_worker_join", worker_id=worker_id, error=str(error))
            return True
        self._last_alive_s[worker_id] = self._clock()
        # Whatever is still in the plan stream was meant for an earlier incarnation.
        pipe.xtrim(self.keys.plans(worker_id), maxlen=0, approximate=False)
        _log.info(
            "worker_joined",
            worker_id=worker_id,
            num_blocks=message.num_blocks,
            block_size=message.block_size,
            max_inflight=message.max_inflight,
        )
        return True

    def _lose(self, worker_id: str, reason: str) -> None:
        """Forget a worker; its requests wait again and are recomputed elsewhere."""
        num_placed = len(self.core.workers[worker_id].placed)
        self.core.worker_lost(worker_id)
        self._last_alive_s.pop(worker_id, None)
        _log.warning("worker_lost", worker_id=worker_id, reason=reason, num_requeued=num_placed)

    async def _check_heartbeats(self, now: float) -> None:
        worker_ids = list(self.core.workers)
        if not worker_ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.exists(self.keys.worker_heartbeat(worker_id))
        alive = await pipe.execute()
        for worker_id, is_alive in zip(worker_ids, alive, strict=True):
            if is_alive:
                self._last_alive_s[worker_id] = now
            elif now - self._last_alive_s.get(worker_id, now) > self.settings.worker_timeout_s:
                self._lose(worker_id, reason="heartbeat_timeout")

    def _refresh_ready(self, pipe: Pipeline) -> None:
        if self.core.workers:
            pipe.set(self.keys.ready, b"1", ex=READY_TTL_S)
        else:
            pipe.delete(self.keys.ready)

    def _queue_plans(self, pipe: Pipeline) -> None:
        """Every plan the core can send now, in order, per worker."""
        for worker_id in self.core.workers:
            while (plan := self.core.next_plan(worker_id)) is not None:
                xadd_message(pipe, self.keys.plans(worker_id), plan, maxlen=PLAN_STREAM_MAXLEN)
                self._counters.num_plans += 1
