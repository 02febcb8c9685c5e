"""The GPU worker actor: the asyncio shell around one engine.

Four owned tasks in one TaskGroup:

- the *reader* XREADGROUPs this worker's plan stream and submits plans in
  order to the engine host (``gpu_worker/engine_host.py``: a process of its
  own for ``python -m gpu_worker``, so the engine's Python never waits for
  this loop's; a thread in tests);
- the *engine* task owns the host's run: plans back to back, each one's
  ``StepDone`` (``gpu_worker/plan_runner.py``: fencing, the step, token
  routing) handed to the loop;
- the *publisher* sends each step's effects in one transaction of a fixed
  number of commands: one PUBLISH of a TokenBatch per gateway, the StepOutput
  to the results stream (the journal: every token of the step, once), the
  XACK of the plan, and a few times a second the stats counters; it also
  hands each step to the worker's metrics (``gpu_worker/metrics.py``);
  the reader and the publisher each make their per-step call on a held
  connection of their own (``shared/redis_lane.py``);
- the *heartbeat* refreshes the worker's TTL key and re-registers when a new
  scheduler (a new epoch) starts.

The engine never waits for the publisher or the event loop: with two plans
in flight (the scheduler sends plan k+1 before result k returns), the next
plan is already queued when a step ends, so the engine runs back to back at
saturation.

No request's data ends the process: a request that fails in a step (the
engine's ``StepOutput.failed``), or every request of a plan that raised
something unexpected, is told to its gateway (``RequestRejected`` with code
``internal``) and ended in its log (``RequestFailed``), in the step's
transaction; the engine goes on with the next plan.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gpu_worker.engine_host import EngineHost, PlanJob
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.step_done import StepDone
from shared.hash_counters import HashCounters, queue_increments
from shared.heartbeat import heartbeat_ttl_ms, sleep_unless_set
from shared.keys import WORKER_GROUP, RedisKeys
from shared.messages import (
    RequestFailed,
    RequestRejected,
    StepOutput,
    TokenBatch,
    WorkerJoined,
    WorkerLeft,
    decode_step_plan,
    encode,
)
from shared.redis_lane import RedisLane
from shared.redis_streams import (
    CONTROL_STREAM_MAXLEN,
    RESULTS_STREAM_MAXLEN,
    position_group_at_end,
    queue_dead_letter,
    read_group,
    reconnect_backoff_s,
    send_message,
    xadd_message,
)
from shared.request_log import queue_failure
from shared.settings import WorkerSettings, served_model_name

READ_BLOCK_MS = 100
READ_COUNT = 16
# Longest the stats hash lags behind the steps at saturation.
STATS_INTERVAL_S = 0.25
# Upper edges (µs) of the histogram of gaps between consecutive forward passes
# that the stats hash keeps, so a benchmark can read the gap's median.
STEP_GAP_EDGES_US = (100, 200, 300, 500, 700, 1000, 1500, 2000, 3000, 5000, 10_000, 100_000)

_log = structlog.get_logger(__name__)


class WorkerActor:
    """Registers an engine's K/V capacity and runs the plans the scheduler sends it."""

    def __init__(self, settings: WorkerSettings, redis: aioredis.Redis, host: EngineHost) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.keys = RedisKeys(settings.redis.prefix)
        self.host = host
        self._redis = redis
        self._plans_stream = self.keys.plans(self.worker_id)
        # Once per step each: the plan read and the step's transaction, each
        # on a connection of its own task (``shared/redis_lane.py``).
        self._read_lane = RedisLane(redis)
        self._publish_lane = RedisLane(redis)
        self._joined_epoch: int | None = None
        self._stats = HashCounters(STATS_INTERVAL_S)
        # Served at /metrics by the process (``__main__``) when asked to.
        self.metrics = WorkerMetrics(
            self.worker_id,
            self.host.stats,
            model_name=served_model_name(settings.model.model_dir),
        )

    @property
    def heartbeat_ttl_ms(self) -> int:
        """Lifetime of the heartbeat key after each refresh."""
        return heartbeat_ttl_ms(self.settings.heartbeat_s)

    def joined_message(self) -> WorkerJoined:
        """The registration this worker sends."""
        return WorkerJoined(
            worker_id=self.worker_id,
            num_blocks=self.host.num_blocks,
            block_size=self.host.block_size,
            max_inflight=self.settings.max_inflight,
            pipeline_depth=self.settings.pipeline_parallel,
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
            num_blocks=self.host.num_blocks,
            block_size=self.host.block_size,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Start the engine, register, serve plans until ``stop`` is set, then leave."""
        await self.host.start()
        await self.register()
        done: asyncio.Queue[StepDone | None] = asyncio.Queue()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._heartbeat(stop))
                tasks.create_task(self._read(stop))
                tasks.create_task(self.host.run(stop, done))
                tasks.create_task(self._publish(done))
        finally:
            await self._read_lane.close()
            await self._publish_lane.close()
        await send_message(
            self._redis,
            self.keys.control,
            WorkerLeft(worker_id=self.worker_id),
            maxlen=CONTROL_STREAM_MAXLEN,
        )
        await self._redis.delete(self.keys.worker_heartbeat(self.worker_id))
        _log.info("worker_left", worker_id=self.worker_id, num_steps=self.host.stats.num_steps)

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

    async def _read(self, stop: asyncio.Event) -> None:
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
                        lane=self._read_lane,
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
                    self.host.submit(PlanJob(entry.entry_id, entry.message, received_at))
        finally:
            self.host.close()

    async def _publish(self, done: asyncio.Queue[StepDone | None]) -> None:
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

    async def _publish_one(self, item: StepDone) -> None:
        """One step's effects in one MULTI/EXEC, a fixed number of commands
        whatever the batch: the tokens a gateway sees are exactly those in the
        step's journal entry, which the scheduler reads and request logs fold."""
        pipe = self._redis.pipeline(transaction=True)
        if item.dead_error is not None and item.dead_plan is not None:
            queue_dead_letter(
                pipe, self.keys.dead, self._plans_stream, item.dead_error, item.dead_plan
            )
        for gateway_id, tokens in item.batches.items():
            batch = TokenBatch(worker_id=self.worker_id, tokens=tokens)
            pipe.publish(self.keys.tokens(gateway_id), encode(batch))
        retention_s = self.settings.redis.log_retention_s
        for failed in item.failures:
            failure = failed.failure
            rejected = RequestRejected(failure.request_id, code="internal", message=failure.message)
            pipe.publish(self.keys.tokens(failed.gateway_id), encode(rejected))
            ended = RequestFailed(failure.request_id, code="internal", message=failure.message)
            queue_failure(pipe, self.keys, ended, retention_s)
        output = item.output
        if output is not None:
            # The journal: this step's tokens, once, for the scheduler and the logs.
            xadd_message(pipe, self.keys.results, output, maxlen=RESULTS_STREAM_MAXLEN)
        pipe.xack(self._plans_stream, WORKER_GROUP, item.entry_id)
        pipe.xdel(self._plans_stream, item.entry_id)
        # The stats a few times a second, and at once when the engine is idle.
        increments = self._stats.take_if_due(force=self.host.num_in_flight == 0)
        queue_increments(pipe, self.keys.stats, increments)
        try:
            await self._publish_lane.execute(pipe)
        except BaseException:
            self._stats.give_back(increments)
            raise

    def _count(self, output: StepOutput, item: StepDone) -> None:
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
