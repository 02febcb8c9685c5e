"""The GPU worker actor: the asyncio shell around one ``Engine``.

Four owned tasks in one TaskGroup, joined by two queues:

- the *reader* XREADGROUPs this worker's plan stream and queues plans in order;
- the *engine thread* (owned by a task that awaits it) takes plans from a
  thread-safe queue and runs them back to back, so the loop keeps doing
  Redis I/O meanwhile and no event-loop hop sits between two forward passes;
  it hands each output to the loop;
- the *publisher* sends each step's effects in one transaction of a fixed
  number of commands: one PUBLISH of a TokenBatch per gateway, the StepOutput
  to the results stream (the journal: every token of the step, once), the
  XACK of the plan, and a few times a second the stats counters; it also hands each step to
  the worker's metrics (``gpu_worker/metrics.py``);
- the *heartbeat* refreshes the worker's TTL key and re-registers when a new
  scheduler (a new epoch) starts.

The engine thread never waits for the publisher or the event loop: with two
plans in flight (the scheduler sends plan k+1 before result k returns), the
next plan is already queued when a step ends, so the engine runs back to back
at saturation. Everything that reads or changes engine state (epoch fencing,
stale admissions, the step itself, token routing) happens on that thread.

Fencing: plans of an epoch older than the newest seen are skipped; the first
plan of a newer epoch drops every request of the old scheduler first.

No request's data ends the process: a request that fails in a step (the
engine's ``StepOutput.failed``), or every request of a plan that raised
something unexpected, is told to its gateway (``RequestRejected`` with code
``internal``) and ended in its log (``RequestFailed``), in the step's
transaction; the engine thread goes on with the next plan.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gpu_worker.engine import STEP_FAILED_MESSAGE, Engine, PlanError
from gpu_worker.metrics import WorkerMetrics
from shared.hash_counters import HashCounters, queue_increments
from shared.heartbeat import heartbeat_ttl_ms, sleep_unless_set
from shared.keys import WORKER_GROUP, RedisKeys
from shared.messages import (
    RequestFailed,
    RequestFailure,
    RequestRejected,
    SampledToken,
    StepOutput,
    StepPlan,
    StepTiming,
    TokenBatch,
    WorkerJoined,
    WorkerLeft,
    decode_step_plan,
    encode,
)
from shared.redis_streams import (
    CONTROL_STREAM_MAXLEN,
    RESULTS_STREAM_MAXLEN,
    StreamEntry,
    position_group_at_end,
    queue_dead_letter,
    read_group,
    reconnect_backoff_s,
    send_message,
    xadd_message,
)
from shared.request_log import queue_failure
from shared.settings import WorkerSettings

READ_BLOCK_MS = 100
READ_COUNT = 16
SUMMARY_EVERY_STEPS = 200
# Longest the stats hash lags behind the steps at saturation.
STATS_INTERVAL_S = 0.25
# Upper edges (µs) of the histogram of gaps between consecutive forward passes
# that the stats hash keeps, so a benchmark can read the gap's median.
STEP_GAP_EDGES_US = (100, 200, 300, 500, 700, 1000, 1500, 2000, 3000, 5000, 10_000, 100_000)

_log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Received:
    """A plan as the reader queued it, with when it was read (``time.time()``)."""

    entry: StreamEntry[StepPlan]
    received_at: float


@dataclass
class _Done:
    """What the publisher sends for one plan entry."""

    entry_id: bytes
    output: StepOutput | None  # None: a skipped plan, only acknowledged
    batches: dict[str, list[SampledToken]] = field(default_factory=dict)
    dead_plan: tuple[str, bytes] | None = None  # (error, plan bytes) of a refused plan
    num_requests: int = 0  # requests in the step's forward pass (its batch size)
    step_gap_s: float | None = None  # time outside forward passes since the previous step
    # (gateway id, failure) of each request that ended with an error in this step
    failures: list[tuple[str, RequestFailure]] = field(default_factory=list)


class WorkerActor:
    """Registers an engine's K/V capacity and runs the plans the scheduler sends it."""

    def __init__(self, settings: WorkerSettings, redis: aioredis.Redis, engine: Engine) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.keys = RedisKeys(settings.redis.prefix)
        self.engine = engine
        self.epoch = 0
        self._redis = redis
        self._plans_stream = self.keys.plans(self.worker_id)
        self._gateway_ids: dict[str, str] = {}
        self._joined_epoch: int | None = None
        self._window_started_s = time.monotonic()
        self._window_busy_s = 0.0
        self._num_steps = 0
        self._last_step_end_s: float | None = None
        self._stats = HashCounters(STATS_INTERVAL_S)
        # Whether the engine thread is running a plan (written by that thread only).
        self._engine_busy = False
        self._last_step_index = -1  # of this epoch's plans: each must come after the last
        # Served at /metrics by the process (``__main__``) when asked to.
        self.metrics = WorkerMetrics(self.worker_id, engine.stats)

    @property
    def heartbeat_ttl_ms(self) -> int:
        """Lifetime of the heartbeat key after each refresh."""
        return heartbeat_ttl_ms(self.settings.heartbeat_s)

    def joined_message(self) -> WorkerJoined:
        """The registration this worker sends."""
        return WorkerJoined(
            worker_id=self.worker_id,
            num_blocks=self.engine.num_blocks,
            block_size=self.engine.block_size,
            max_inflight=self.settings.max_inflight,
        )

    async def register(self) -> None:
        """Announce ourselves alive, then join.

        The plan group is moved to the stream's end *before* the join is sent:
        everything already there was meant for an earlier incarnation of this
        worker id, and every plan for this one is written after the scheduler
        reads the join, so it lies past that point and is delivered.
        """
        await self._redis.set(
            self.keys.worker_heartbeat(self.worker_id), b"1", px=self.heartbeat_ttl_ms
        )
        await position_group_at_end(self._redis, self._plans_stream, WORKER_GROUP)
        epoch = await self._redis.get(self.keys.epoch)
        self._joined_epoch = None if epoch is None else int(epoch)
        await send_message(
            self._redis, self.keys.control, self.joined_message(), maxlen=CONTROL_STREAM_MAXLEN
        )
        _log.info(
            "worker_registered",
            worker_id=self.worker_id,
            num_blocks=self.engine.num_blocks,
            block_size=self.engine.block_size,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Register, serve plans until ``stop`` is set, then leave."""
        await self.register()
        plans: queue.SimpleQueue[_Received | None] = queue.SimpleQueue()
        done: asyncio.Queue[_Done | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._heartbeat(stop))
            tasks.create_task(self._read(stop, plans))
            tasks.create_task(asyncio.to_thread(self._run_engine, stop, plans, done, loop))
            tasks.create_task(self._publish(done))
        await send_message(
            self._redis,
            self.keys.control,
            WorkerLeft(worker_id=self.worker_id),
            maxlen=CONTROL_STREAM_MAXLEN,
        )
        await self._redis.delete(self.keys.worker_heartbeat(self.worker_id))
        _log.info("worker_left", worker_id=self.worker_id, num_steps=self._num_steps)

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await sleep_unless_set(stop, self.settings.heartbeat_s)
            if stop.is_set():
                return
            try:
                await self._beat()
            except (RedisError, OSError) as error:
                _log.warning("heartbeat_failed", error=str(error))

    async def _beat(self) -> None:
        """Refresh the heartbeat; join again when a new scheduler (epoch) started."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self.keys.worker_heartbeat(self.worker_id), b"1", px=self.heartbeat_ttl_ms)
        pipe.get(self.keys.epoch)
        _, raw_epoch = await pipe.execute()
        epoch = None if raw_epoch is None else int(raw_epoch)
        if self._joined_epoch is not None and epoch is not None and epoch != self._joined_epoch:
            # A new scheduler knows nothing of us until we join again.
            await send_message(
                self._redis, self.keys.control, self.joined_message(), maxlen=CONTROL_STREAM_MAXLEN
            )
            _log.info("worker_rejoined", worker_id=self.worker_id, epoch=epoch)
        if epoch is not None:
            self._joined_epoch = epoch

    async def _read(self, stop: asyncio.Event, plans: queue.SimpleQueue[_Received | None]) -> None:
        decoders = {self._plans_stream: decode_step_plan}
        failures = 0
        try:
            while not stop.is_set():
                try:
                    entries = await read_group(
                        self._redis,
                        WORKER_GROUP,
                        self.worker_id,
                        decoders,
                        self.keys.dead,
                        block_ms=READ_BLOCK_MS,
                        count=READ_COUNT,
                    )
                except (RedisError, OSError) as error:
                    # A plan lost with the connection is fenced off by the new
                    # epoch the scheduler takes when Redis comes back.
                    _log.warning("plan_read_failed", error=str(error), failures=failures)
                    await asyncio.sleep(reconnect_backoff_s(failures))
                    failures += 1
                    continue
                failures = 0
                received_at = time.time()
                for entry in entries:
                    plans.put_nowait(_Received(entry, received_at))
        finally:
            plans.put_nowait(None)

    def _run_engine(
        self,
        stop: asyncio.Event,
        plans: queue.SimpleQueue[_Received | None],
        done: asyncio.Queue[_Done | None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """The engine thread: run plans in order until the reader ends the queue."""
        try:
            while (received := plans.get()) is not None and not stop.is_set():
                self._engine_busy = True
                started_at = time.time()
                item = self._run_plan_or_fail(received.entry)
                if item.output is not None and item.output.num_new_tokens:
                    timing = StepTiming(
                        planned_at=received.entry.message.planned_at,
                        received_at=received.received_at,
                        started_at=started_at,
                        ended_at=time.time(),
                        forward_s=item.output.step_ms / 1000,
                    )
                    item.output = msgspec.structs.replace(item.output, timing=timing)
                self._engine_busy = False
                loop.call_soon_threadsafe(done.put_nowait, item)
        finally:
            # Plans left unrun stay pending; the scheduler recomputes their requests.
            loop.call_soon_threadsafe(done.put_nowait, None)

    def _run_plan_or_fail(self, entry: StreamEntry[StepPlan]) -> _Done:
        """Run a plan; anything it raises that the engine did not turn into a
        failure ends the plan's requests (never the engine thread)."""
        try:
            return self._run_plan(entry)
        except Exception:  # a bug or a device fault: this plan's requests end, the worker goes on
            plan = entry.message
            _log.exception("plan_failed", step_index=plan.step_index, epoch=plan.epoch)
            return self._fail_plan(entry)

    def _fail_plan(self, entry: StreamEntry[StepPlan]) -> _Done:
        """Every request the plan names ends with an error (the engine may not
        hold all of them: the scheduler still does); the plan goes to dead."""
        plan = entry.message
        request_ids = list(
            dict.fromkeys(
                [
                    *(spec.request_id for spec in plan.new_requests),
                    *(chunk.request_id for chunk in plan.prefill_chunks),
                    *plan.decode_request_ids,
                ]
            )
        )
        try:
            self.engine.fail_requests(request_ids, STEP_FAILED_MESSAGE)
        except Exception:  # best effort: the engine's state is suspect already
            _log.exception("failed_requests_not_dropped", request_ids=request_ids)
        for spec in plan.new_requests:
            self._gateway_ids.setdefault(spec.request_id, spec.gateway_id)
        failed = [RequestFailure(rid, STEP_FAILED_MESSAGE) for rid in request_ids]
        output = StepOutput(
            worker_id=self.worker_id, epoch=plan.epoch, step_index=plan.step_index, failed=failed
        )
        failures = [(self._gateway_ids.pop(f.request_id, ""), f) for f in failed]
        dead = ("the worker failed to run this plan", encode(plan))
        return _Done(entry.entry_id, output, dead_plan=dead, failures=failures)

    def _run_plan(self, entry: StreamEntry[StepPlan]) -> _Done:
        plan = entry.message
        if plan.epoch < self.epoch:
            # No scheduler waits for it: no output, only the dead letter.
            _log.info("stale_plan_skipped", step_index=plan.step_index, epoch=plan.epoch)
            stale = f"plan of epoch {plan.epoch}, older than the worker's {self.epoch}"
            return _Done(entry.entry_id, None, dead_plan=(stale, encode(plan)))
        if plan.epoch > self.epoch:
            self._forget_everything(plan.epoch)
        try:
            if plan.step_index <= self._last_step_index:
                raise PlanError(
                    f"step {plan.step_index} comes after step {self._last_step_index}: "
                    "plans must come in the order they were made"
                )
            plan = self._release_stale_admissions(plan)
            output = self.engine.step(plan)
            step_end_s = time.perf_counter()
        except PlanError as error:
            # Refused whole, state unchanged; the empty output tells the scheduler
            # the step ran nothing, so it plans those requests again.
            _log.error("plan_refused", step_index=plan.step_index, error=str(error))
            empty = StepOutput(
                worker_id=self.worker_id, epoch=plan.epoch, step_index=plan.step_index
            )
            return _Done(entry.entry_id, empty, dead_plan=(str(error), encode(plan)))
        self._last_step_index = plan.step_index
        gateway_ids = self._gateway_ids
        for spec in plan.new_requests:
            gateway_ids[spec.request_id] = spec.gateway_id
        for request_id in plan.released_request_ids:
            gateway_ids.pop(request_id, None)
        batches: dict[str, list[SampledToken]] = defaultdict(list)
        for token in output.tokens:
            if token.finish_reason is None:
                batches[gateway_ids.get(token.request_id, "")].append(token)
            else:
                batches[gateway_ids.pop(token.request_id, "")].append(token)
        failures = [(gateway_ids.pop(f.request_id, ""), f) for f in output.failed]
        if failures:
            _log.warning(
                "requests_failed",
                step_index=plan.step_index,
                request_ids=[f.request_id for _, f in failures],
                errors=[f.message for _, f in failures],
            )
        self._summarize(output)
        step_gap_s = None
        if output.num_new_tokens:
            # Wall time between this forward pass and the previous one: the
            # control plane's share (plan wait, bookkeeping outside the forward).
            if self._last_step_end_s is not None:
                step_gap_s = max(0.0, step_end_s - self._last_step_end_s - output.step_ms / 1000)
            self._last_step_end_s = step_end_s
        num_requests = len(plan.prefill_chunks) + len(plan.decode_request_ids)
        return _Done(
            entry.entry_id, output, dict(batches), None, num_requests, step_gap_s, failures
        )

    def _forget_everything(self, epoch: int) -> None:
        """A new scheduler: drop the old one's requests (their K/V goes back to the pool)."""
        stale_ids = self.engine.active_request_ids
        if stale_ids:
            release = StepPlan(
                worker_id=self.worker_id,
                epoch=epoch,
                step_index=-1,
                released_request_ids=stale_ids,
            )
            self.engine.step(release)
        self._gateway_ids.clear()
        _log.info("new_epoch", epoch=epoch, num_dropped=len(stale_ids))
        self.epoch = epoch
        self._last_step_index = -1

    def _release_stale_admissions(self, plan: StepPlan) -> StepPlan:
        """A plan admits a request only when the scheduler holds no state of it here,
        so state the engine still has for it (a plan of an earlier incarnation of
        this worker id, read before the scheduler saw our join) is stale: drop it."""
        if not plan.new_requests:
            return plan
        active = set(self.engine.active_request_ids)
        released = set(plan.released_request_ids)
        stale_ids = [
            spec.request_id
            for spec in plan.new_requests
            if spec.request_id in active and spec.request_id not in released
        ]
        if not stale_ids:
            return plan
        _log.warning("stale_requests_released", request_ids=stale_ids)
        return msgspec.structs.replace(
            plan, released_request_ids=[*plan.released_request_ids, *stale_ids]
        )

    async def _publish(self, done: asyncio.Queue[_Done | None]) -> None:
        failures = 0
        while (item := await done.get()) is not None:
            if item.output is not None:
                self.metrics.observe_step(item.output, item.num_requests)
                self._count(item.output, item)
            while True:
                try:
                    sent_at = time.perf_counter()
                    await self._publish_one(item)
                    # Round trips of the steps' transactions.
                    self._stats.add(f"{self.worker_id}:commit_s", time.perf_counter() - sent_at)
                    failures = 0
                    break
                except (RedisError, OSError) as error:
                    # Nothing of the step is out (one transaction): send it again
                    # once Redis answers. A step sent twice is harmless: the log
                    # and the gateways keep each token index once, the scheduler
                    # ignores a result it already has.
                    _log.warning("publish_failed", error=str(error), failures=failures)
                    await asyncio.sleep(reconnect_backoff_s(failures))
                    failures += 1

    async def _publish_one(self, item: _Done) -> None:
        """One step's effects in one MULTI/EXEC, a fixed number of commands
        whatever the batch: the tokens a gateway sees are exactly those in the
        step's journal entry, which the scheduler reads and request logs fold."""
        pipe = self._redis.pipeline(transaction=True)
        if item.dead_plan is not None:
            error, data = item.dead_plan
            queue_dead_letter(pipe, self.keys.dead, self._plans_stream, error, data)
        for gateway_id, tokens in item.batches.items():
            batch = TokenBatch(worker_id=self.worker_id, tokens=tokens)
            pipe.publish(self.keys.tokens(gateway_id), encode(batch))
        retention_s = self.settings.redis.log_retention_s
        for gateway_id, failure in item.failures:
            rejected = RequestRejected(failure.request_id, code="internal", message=failure.message)
            pipe.publish(self.keys.tokens(gateway_id), encode(rejected))
            ended = RequestFailed(failure.request_id, code="internal", message=failure.message)
            queue_failure(pipe, self.keys, ended, retention_s)
        output = item.output
        if output is not None:
            # The journal: this step's tokens, once, for the scheduler and the logs.
            xadd_message(pipe, self.keys.results, output, maxlen=RESULTS_STREAM_MAXLEN)
        pipe.xack(self._plans_stream, WORKER_GROUP, item.entry_id)
        pipe.xdel(self._plans_stream, item.entry_id)
        # The stats a few times a second, and at once when the engine is idle.
        increments = self._stats.take_if_due(force=not self._engine_busy)
        queue_increments(pipe, self.keys.stats, increments)
        try:
            await pipe.execute()
        except BaseException:
            self._stats.give_back(increments)
            raise

    def _count(self, output: StepOutput, item: _Done) -> None:
        """The step's stats-hash counters (sent with this or a later step's transaction)."""
        stats, worker_id = self._stats, self.worker_id
        if output.num_new_tokens:
            stats.add(f"{worker_id}:busy_s", output.step_ms / 1000)
            stats.add(f"{worker_id}:num_steps", 1)
            stats.add(f"{worker_id}:num_tokens", output.num_new_tokens)
            stats.add(f"{worker_id}:num_requests", item.num_requests)
        if item.step_gap_s is not None:
            # Sum, count and histogram bucket of one gap between forward passes.
            gap_us = item.step_gap_s * 1e6
            edge = next((str(edge) for edge in STEP_GAP_EDGES_US if gap_us <= edge), "inf")
            stats.add(f"{worker_id}:step_gap_s", item.step_gap_s)
            stats.add(f"{worker_id}:num_step_gaps", 1)
            stats.add(f"{worker_id}:step_gap_le_us:{edge}", 1)

    def _summarize(self, output: StepOutput) -> None:
        """The hot loop's log: one summary line every SUMMARY_EVERY_STEPS steps."""
        if not output.num_new_tokens:
            return
        self._num_steps += 1
        self._window_busy_s += output.step_ms / 1000
        if self._num_steps % SUMMARY_EVERY_STEPS == 0:
            now = time.monotonic()
            wall_s = max(now - self._window_started_s, 1e-9)
            _log.info(
                "worker_summary",
                num_steps=self._num_steps,
                num_tokens=self.engine.stats.num_tokens,
                busy_fraction=round(self._window_busy_s / wall_s, 3),
                num_active_requests=len(self.engine.active_request_ids),
                num_free_blocks=self.engine.num_free_blocks,
            )
            self._window_started_s, self._window_busy_s = now, 0.0
