"""The scheduler actor: the asyncio shell that moves messages between Redis and the core.

One loop owns the core. Each turn it reads whatever is new on the results,
control and requests streams (one XREADGROUP over the three, blocking at most
``READ_BLOCK_MS``), applies every message to the core as an event, asks the
core for every plan it can send now, and then, in one pipelined round trip,
XADDs the plans, publishes rejections and acknowledges the messages it
applied. Once a second it also checks worker heartbeats, refreshes the
ready key and checks that Redis is still the same server process.

Durability: a ``SubmitRequest`` stays pending in the requests stream's
consumer group until its request ends, and each request's log (see
``shared/request_log.py``) holds the tokens already sent. A new incarnation
(a restarted process, or this one after Redis failed or restarted) takes a
new epoch, so workers drop the old plans' state, and recovers every pending
request with its tokens from the log: it is recomputed from prompt + those
tokens, and the client sees each token once.

Every request that ends here with an error (refused at submit, or on two
workers that failed) is told to its gateway (``RequestRejected``) and ended
in its log (``RequestFailed``, which also shortens the log's TTL to the
retention), and its submit is acknowledged and deleted. A request a worker
reported failed was told and logged by that worker; here its submit is acked.

Overlap: workers join with ``max_inflight`` 2, so the core keeps a second
plan queued behind the one running. A result wakes the blocked XREADGROUP at
once and the plan that replaces it goes out in the same turn; a worker thus
finds its next plan already in its stream when a step ends.

Metrics (``scheduler_actor/metrics.py``) read the core when scraped; the
plans of a turn are counted once its transaction went through. The live view
(``scheduler_actor/live_view.py``) records each plan and result; every
``PUBLISH_INTERVAL_S`` a turn's transaction also sets its snapshot, with a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline
from redis.exceptions import AuthenticationError, RedisError

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
    SchedulerError,
)
from scheduler_actor.live_view import LiveView
from scheduler_actor.liveness import Liveness
from scheduler_actor.metrics import SchedulerMetrics
from scheduler_actor.request import FinishedRequest
from scheduler_actor.step_timing import StepTimingTotals
from shared.heartbeat import sleep_unless_set
from shared.keys import SCHEDULER_GROUP, RedisKeys
from shared.live_stats import PUBLISH_INTERVAL_S, TTL_MS, encode_snapshot
from shared.messages import (
    CancelRequest,
    RequestAdopted,
    RequestEnded,
    RequestFailed,
    RequestRejected,
    StepOutput,
    StepPlan,
    SubmitRequest,
    WorkerJoined,
    WorkerLeft,
    decode_control_message,
    decode_step_output,
    encode,
)
from shared.redis_streams import (
    PLAN_STREAM_MAXLEN,
    StreamEntry,
    ensure_group,
    read_group,
    read_pending,
    reconnect_backoff_s,
    xadd_message,
)
from shared.request_log import queue_end, queue_failure, read_request_logs
from shared.settings import SchedulerSettings

READ_BLOCK_MS = 100
READ_COUNT = 1024
HOUSEKEEPING_S = 1.0
READY_TTL_S = 3
SUMMARY_EVERY_S = 10.0
CONSUMER_NAME = "scheduler"

Event = SubmitRequest | CancelRequest | RequestAdopted | WorkerJoined | WorkerLeft | StepOutput

_log = structlog.get_logger(__name__)


class RedisRestartedError(Exception):
    """Redis answers as a new server process: what it lost is unknown, so the
    scheduler starts a new incarnation from what Redis holds now."""


def scheduler_config(settings: SchedulerSettings, epoch: int) -> SchedulerConfig:
    """The core's configuration from the actor's settings."""
    return SchedulerConfig(
        policy=PolicyName(settings.policy),
        max_batch_size=settings.max_batch_size,
        token_budget=settings.token_budget,
        max_chunk_tokens=settings.max_chunk_tokens,
        max_waiting=settings.max_waiting,
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
        self._workers_alive = Liveness(settings.worker_timeout_s)
        self._gateways_alive = Liveness(settings.orphan_timeout_s)
        self._next_housekeeping_s = 0.0
        self._next_summary_s = 0.0
        self._next_publish_s = 0.0
        self._counters = _Counters()
        # Served at /metrics by the process (``__main__``) when asked to.
        self.metrics = SchedulerMetrics()
        self._live = LiveView()
        self._timing = StepTimingTotals()
        self._epoch = 0
        self._redis_run_id = ""
        # Request id -> its SubmitRequest's entry, acknowledged when the request ends.
        self._submit_entry_ids: dict[str, bytes] = {}
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
        """Take a new epoch, make sure the consumer groups exist and recover
        every request an earlier incarnation left unfinished."""
        epoch = int(await self._redis.incr(self.keys.epoch))
        if epoch <= self._epoch:
            # Redis came back without the counter: stay above the fenced epochs.
            epoch = self._epoch + 1
            await self._redis.set(self.keys.epoch, epoch)
        self._epoch = epoch
        self._core = Scheduler(scheduler_config(self.settings, epoch), self._clock)
        self.metrics.watch(self._core)
        # Step indices start again with the new core.
        self._live = LiveView()
        self._workers_alive.clear()
        self._gateways_alive.clear()
        self._submit_entry_ids.clear()
        # "0": a worker may have joined, or a gateway submitted, before we started.
        for stream in self._decoders:
            await ensure_group(self._redis, stream, SCHEDULER_GROUP, start_id="0")
        self._redis_run_id = await self._server_run_id()
        num_recovered = await self._recover()
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
            _log.info("scheduler_stopped", **vars(self._counters))

    async def _recover(self) -> int:
        """Take back what an earlier incarnation read and did not finish: every
        pending request (with the tokens its log says were sent), pending
        cancels and joins; its pending results are stale (their tokens are in
        the logs). Returns the number of requests recovered."""
        redis, dead = self._redis, self.keys.dead
        pipe = self._redis.pipeline(transaction=True)
        pending = await read_pending(
            redis, SCHEDULER_GROUP, CONSUMER_NAME, self.keys.requests, decode_control_message, dead
        )
        submits: list[tuple[bytes, SubmitRequest]] = []
        for entry in pending:
            if isinstance(entry.message, SubmitRequest):
                submits.append((entry.entry_id, entry.message))
            else:
                self._ack(pipe, self.keys.requests, entry.entry_id)
        logs = await read_request_logs(redis, self.keys, [m.request_id for _, m in submits])
        for (entry_id, message), log in zip(submits, logs, strict=True):
            if log is not None and log.is_finished:
                self._ack(pipe, self.keys.requests, entry_id)
            else:
                generated_ids = [] if log is None else log.token_ids
                self._submit(entry_id, message, pipe, generated_ids=generated_ids)
        for entry in await read_pending(
            redis, SCHEDULER_GROUP, CONSUMER_NAME, self.keys.control, decode_control_message, dead
        ):
            await self._apply(entry, pipe)
            self._ack(pipe, self.keys.control, entry.entry_id)
        for result in await read_pending(
            redis, SCHEDULER_GROUP, CONSUMER_NAME, self.keys.results, decode_step_output, dead
        ):
            self._ack(pipe, self.keys.results, result.entry_id)
        if len(pipe):
            await pipe.execute()
        return len(self._submit_entry_ids)

    async def _server_run_id(self) -> str:
        """The Redis server process's run id: a new one means Redis restarted."""
        info = await self._redis.info("server")
        return str(info.get("run_id", ""))

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
        read_at = time.time()
        work_started = time.perf_counter()
        # One transaction: the plans, rejections and acknowledgements of a turn
        # reach Redis together or not at all.
        pipe = self._redis.pipeline(transaction=True)
        membership_changed = False
        for entry in entries:
            if isinstance(entry.message, StepOutput) and entry.message.timing is not None:
                self._timing.add_step(entry.message.timing, read_at)
            membership_changed |= await self._apply(entry, pipe)
        now = self._clock()
        if now >= self._next_housekeeping_s:
            self._next_housekeeping_s = now + HOUSEKEEPING_S
            if await self._server_run_id() != self._redis_run_id:
                raise RedisRestartedError
            await self._check_heartbeats(now, pipe)
            membership_changed = True
        if membership_changed:
            self._refresh_ready(pipe)
        plans = self._queue_plans(pipe)
        if now >= self._next_publish_s:
            self._next_publish_s = now + PUBLISH_INTERVAL_S
            self._publish_live_view(pipe)
        for entry in entries:
            # A request's submit stays pending until the request ends.
            if entry.stream != self.keys.requests:
                self._ack(pipe, entry.stream, entry.entry_id)
        if len(pipe):
            if self._timing.num_steps or self._timing.num_turns:
                self._timing.queue_flush(pipe, self.keys.stats)
            work_s = time.perf_counter() - work_started
            await pipe.execute()
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

    async def _apply(self, entry: StreamEntry[Event], pipe: Pipeline) -> bool:
        """Apply one message to the core; True when the set of workers changed."""
        message = entry.message
        core = self.core
        if isinstance(message, StepOutput):
            self._counters.num_results += 1
            finished = core.on_result(message)
            self._live.record_output(message, len(finished))
            self._ack_finished(finished, pipe)
        elif isinstance(message, SubmitRequest):
            self._submit(entry.entry_id, message, pipe)
        elif isinstance(message, CancelRequest):
            self._cancel(message, pipe)
        elif isinstance(message, RequestAdopted):
            core.move_to_gateway(message.request_id, message.gateway_id)
        elif isinstance(message, WorkerJoined):
            return await self._join(message, pipe)
        elif isinstance(message, WorkerLeft) and message.worker_id in core.workers:
            self._lose(message.worker_id, "left", pipe)
            return True
        return False

    def _ack(self, pipe: Pipeline, stream: str, entry_id: bytes) -> None:
        """Done with an entry: acknowledge it, and delete it so the stream stays short."""
        pipe.xack(stream, SCHEDULER_GROUP, entry_id)
        pipe.xdel(stream, entry_id)

    def _ack_finished(self, finished: Sequence[FinishedRequest], pipe: Pipeline) -> None:
        """Requests that ended: their submits leave the pending list."""
        for request in finished:
            entry_id = self._submit_entry_ids.pop(request.request_id, None)
            if entry_id is not None:
                self._ack(pipe, self.keys.requests, entry_id)

    def _submit(
        self,
        entry_id: bytes,
        message: SubmitRequest,
        pipe: Pipeline,
        generated_ids: Sequence[int] | None = None,
    ) -> None:
        """Give a request to the core (``generated_ids``: recovered, with the
        tokens already sent), or refuse it on its gateway's channel."""
        self._counters.num_submitted += 1
        code: str | None = None
        reason = ""
        try:
            self.core.submit(
                message.request_id,
                message.tenant,
                message.prompt_ids,
                message.sampling,
                gateway_id=message.gateway_id,
                generated_ids=generated_ids or (),
                limits=message.limits,
                is_recovered=generated_ids is not None,
            )
        except RequestTooLargeError as error:
            code, reason = "prompt_too_long", str(error)
        except DuplicateRequestError:
            # The same submit again (a gateway re-sent a transaction whose reply
            # it lost): the live request goes on, this copy is dropped.
            _log.info("duplicate_submit_dropped", request_id=message.request_id)
            self._ack(pipe, self.keys.requests, entry_id)
            return
        except InvalidRequestError as error:
            code, reason = "invalid_request", str(error)
        except QueueFullError as error:
            code, reason = "queue_full", str(error)
        if code is not None:
            self._counters.num_rejected += 1
            _log.info("request_rejected", request_id=message.request_id, code=code, reason=reason)
            self._reject(message.request_id, message.gateway_id, code, reason, pipe)
            self._ack(pipe, self.keys.requests, entry_id)
        else:
            self._submit_entry_ids[message.request_id] = entry_id

    def _reject(
        self,
        request_id: str,
        gateway_id: str,
        code: str,
        reason: str,
        pipe: Pipeline,
        end_log: bool = True,
    ) -> None:
        """Tell the gateway the request ended with an error and, with
        ``end_log``, end its log (kept ``log_retention_s`` from now on)."""
        rejection = RequestRejected(request_id=request_id, code=code, message=reason)
        pipe.publish(self.keys.tokens(gateway_id), encode(rejection))
        if end_log:
            failed = RequestFailed(request_id=request_id, code=code, message=reason)
            queue_failure(pipe, self.keys, failed, self.settings.redis.log_retention_s)

    async def _join(self, message: WorkerJoined, pipe: Pipeline) -> bool:
        worker_id = message.worker_id
        # A join read from the stream's history, of a worker long gone, is ignored.
        if not await self._redis.exists(self.keys.worker_heartbeat(worker_id)):
            _log.warning("join_of_dead_worker_ignored", worker_id=worker_id)
            return False
        if worker_id in self.core.workers:
            self._lose(worker_id, "rejoined", pipe)
        try:
            self.core.worker_joined(
                worker_id, message.num_blocks, message.block_size, message.max_inflight
            )
        except SchedulerError as error:
            _log.warning("bad_worker_join", worker_id=worker_id, error=str(error))
            return True
        self._workers_alive.alive(worker_id, self._clock())
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

    def _lose(self, worker_id: str, reason: str, pipe: Pipeline) -> None:
        """Forget a worker; its requests wait again and are recomputed elsewhere,
        except those it was the second failed worker of: they end with an error."""
        num_placed = len(self.core.workers[worker_id].placed)
        # A clean leave (SIGTERM) is no failure of the worker's requests.
        ended = self.core.worker_lost(worker_id, failed=reason != "left")
        failed = [request for request in ended if request.finish_reason == "error"]
        for request in failed:
            self._reject(request.request_id, request.gateway_id, "internal", request.error, pipe)
        self._ack_finished(ended, pipe)
        self._workers_alive.forget(worker_id)
        _log.warning(
            "worker_lost",
            worker_id=worker_id,
            reason=reason,
            num_requeued=num_placed - len(failed),
            failed_request_ids=[request.request_id for request in failed],
        )

    async def _check_heartbeats(self, now: float, turn_pipe: Pipeline) -> None:
        """Lose silent workers; cancel the requests of gateways silent for
        ``orphan_timeout_s`` (nobody resumed them elsewhere meanwhile)."""
        worker_ids = list(self.core.workers)
        gateway_ids = sorted(
            {request.gateway_id for request in self.core.requests.values() if request.gateway_id}
        )
        if not worker_ids and not gateway_ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.exists(self.keys.worker_heartbeat(worker_id))
        for gateway_id in gateway_ids:
            pipe.exists(self.keys.gateway_heartbeat(gateway_id))
        alive = await pipe.execute()
        for worker_id, is_alive in zip(worker_ids, alive, strict=False):
            if self._workers_alive.is_gone(worker_id, bool(is_alive), now):
                self._lose(worker_id, "heartbeat_timeout", turn_pipe)
        for gateway_id, is_alive in zip(gateway_ids, alive[len(worker_ids) :], strict=True):
            if self._gateways_alive.is_gone(gateway_id, bool(is_alive), now):
                self._cancel_orphans(gateway_id, turn_pipe)

    def _cancel(self, message: CancelRequest, pipe: Pipeline) -> None:
        """A gateway's cancel; a conditional one (``gateway_id``) only while that
        gateway still serves the request, and then its log records the end."""
        request = self.core.requests.get(message.request_id)
        if request is None:
            return
        if message.gateway_id:
            if request.gateway_id != message.gateway_id:
                return  # resumed on another gateway meanwhile
            ended = RequestEnded(request.request_id, num_tokens=len(request.generated_ids))
            queue_end(pipe, self.keys, ended, self.settings.redis.log_retention_s)
        self._ack_finished(self.core.cancel(message.request_id), pipe)

    def _cancel_orphans(self, gateway_id: str, pipe: Pipeline) -> None:
        """The gateway died and no other took its requests over: stop them (their
        logs say so, for a client that comes back later)."""
        self._gateways_alive.forget(gateway_id)
        orphans = [r for r in self.core.requests.values() if r.gateway_id == gateway_id]
        for request in orphans:
            ended = RequestEnded(request.request_id, num_tokens=len(request.generated_ids))
            queue_end(pipe, self.keys, ended, self.settings.redis.log_retention_s)
            self._ack_finished(self.core.cancel(request.request_id), pipe)
        _log.warning("orphans_cancelled", gateway_id=gateway_id, num_requests=len(orphans))

    def _refresh_ready(self, pipe: Pipeline) -> None:
        if self.core.workers:
            pipe.set(self.keys.ready, b"1", ex=READY_TTL_S)
        else:
            pipe.delete(self.keys.ready)

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
