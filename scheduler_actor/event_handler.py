"""What each message read from Redis does: applied to the core, its effects
queued on the turn's transaction (rejections, log ends, acknowledgements).

One ``EventHandler`` per incarnation of the scheduler (each has its own core).
A request that ends here with an error (refused at submit, or on two workers
that failed) is told to its gateway (``RequestRejected``) and ended in its log
(``RequestFailed``); a submit is acknowledged and deleted once its request
ends. See docs/architecture.md (The actors: Scheduler; Durability).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline

from scheduler_actor.core import Scheduler
from scheduler_actor.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
    SchedulerError,
)
from scheduler_actor.journal_retention import JournalRetention
from scheduler_actor.live_view import LiveView
from scheduler_actor.liveness import Liveness
from scheduler_actor.metrics import SchedulerMetrics
from scheduler_actor.request import FinishedRequest
from shared.keys import SCHEDULER_GROUP, RedisKeys
from shared.messages import (
    CancelRequest,
    RequestAdopted,
    RequestEnded,
    RequestFailed,
    RequestRejected,
    SampledToken,
    StepOutput,
    SubmitRequest,
    WorkerJoined,
    WorkerLeft,
    encode,
)
from shared.redis_streams import StreamEntry
from shared.request_log import RequestLog, queue_checkpoint, queue_end, queue_failure
from shared.settings import SchedulerSettings

Event = SubmitRequest | CancelRequest | RequestAdopted | WorkerJoined | WorkerLeft | StepOutput

_log = structlog.get_logger(__name__)


@dataclass
class SchedulerCounters:
    """What the actor did since its process started (summary and stop lines)."""

    num_plans: int = 0
    num_results: int = 0
    num_submitted: int = 0
    num_rejected: int = 0


# A running request's tokens older than this in the journal go into its log,
# so the journal can be trimmed past them (scheduler_actor/journal_retention.py).
CHECKPOINT_AGE_MS = 10_000


def queue_ack(pipe: Pipeline, keys: RedisKeys, stream: str, entry_id: bytes) -> None:
    """Done with an entry: acknowledge it, and delete it so the stream stays
    short; the journal (``results``) is trimmed instead (``trim_journal``)."""
    pipe.xack(stream, SCHEDULER_GROUP, entry_id)
    if stream != keys.results:
        pipe.xdel(stream, entry_id)


class EventHandler:
    """Applies messages to one core and queues what each one leads to."""

    def __init__(
        self,
        core: Scheduler,
        redis: aioredis.Redis,
        settings: SchedulerSettings,
        counters: SchedulerCounters,
        live: LiveView,
        workers_alive: Liveness,
        clock: Callable[[], float],
        metrics: SchedulerMetrics,
    ) -> None:
        self.core = core
        self._redis = redis
        self._settings = settings
        self._keys = RedisKeys(settings.redis.prefix)
        self._counters = counters
        self._live = live
        # Joins and losses are recorded here; housekeeping checks the heartbeats.
        self._workers_alive = workers_alive
        self._clock = clock
        self._metrics = metrics
        # Request id -> its SubmitRequest's entry, acknowledged when the request ends.
        self._submit_entry_ids: dict[str, bytes] = {}
        self.journal = JournalRetention()

    @property
    def num_live_submits(self) -> int:
        """Submits pending until their request ends."""
        return len(self._submit_entry_ids)

    async def apply(self, entry: StreamEntry[Event], pipe: Pipeline) -> bool:
        """Apply one message to the core; True when the set of workers changed."""
        message = entry.message
        core = self.core
        if isinstance(message, StepOutput):
            self._counters.num_results += 1
            finished = core.on_result(message)
            self._live.record_output(message, len(finished))
            live = core.requests
            self.journal.on_entry(
                entry.entry_id, [t.request_id for t in message.tokens if t.request_id in live]
            )
            self._ack_finished(finished, pipe)
        elif isinstance(message, SubmitRequest):
            self.submit(entry.entry_id, message, pipe)
        elif isinstance(message, CancelRequest):
            self._cancel(message, pipe)
        elif isinstance(message, RequestAdopted):
            core.move_to_gateway(message.request_id, message.gateway_id)
        elif isinstance(message, WorkerJoined):
            return await self._join(message, pipe)
        elif isinstance(message, WorkerLeft) and message.worker_id in core.workers:
            self.lose(message.worker_id, "left", pipe)
            return True
        return False

    def submit(
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
            queue_ack(pipe, self._keys, self._keys.requests, entry_id)
            return
        except InvalidRequestError as error:
            code, reason = "invalid_request", str(error)
        except QueueFullError as error:
            code, reason = "queue_full", str(error)
        if code is not None:
            self._counters.num_rejected += 1
            _log.info("request_rejected", request_id=message.request_id, code=code, reason=reason)
            self._reject(message.request_id, message.gateway_id, code, reason, pipe)
            queue_ack(pipe, self._keys, self._keys.requests, entry_id)
        else:
            self._submit_entry_ids[message.request_id] = entry_id

    def lose(self, worker_id: str, reason: str, pipe: Pipeline) -> None:
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

    def cancel_orphans(self, gateway_id: str, pipe: Pipeline) -> None:
        """The gateway died and no other took its requests over: stop them (their
        logs say so, for a client that comes back later)."""
        orphans = [r for r in self.core.requests.values() if r.gateway_id == gateway_id]
        for request in orphans:
            ended = RequestEnded(request.request_id, num_tokens=len(request.generated_ids))
            queue_end(pipe, self._keys, ended, self._settings.redis.log_retention_s)
            self._ack_finished(self.core.cancel(request.request_id), pipe)
        _log.warning("orphans_cancelled", gateway_id=gateway_id, num_requests=len(orphans))

    def checkpoint_recovered(self, log: RequestLog, pipe: Pipeline) -> None:
        """A recovered request's tokens go into its log (those only in the journal
        too: this incarnation trims the journal past what it did not read)."""
        retention_s = self._settings.redis.log_retention_s if log.is_finished else None
        queue_checkpoint(pipe, self._keys, log.sampled_tokens(), retention_s)
        self.journal.logged(log.request_id, len(log.token_ids))

    def trim_journal(self, pipe: Pipeline) -> None:
        """Checkpoint the running requests whose tokens hold the journal longest,
        then trim it to the oldest entry still holding a token no log has."""
        for request_id in self.journal.due(CHECKPOINT_AGE_MS):
            request = self.core.requests.get(request_id)
            if request is None:
                self.journal.forget(request_id)
                continue
            num_logged = self.journal.num_logged(request_id)
            tokens = [
                SampledToken(request_id, token_id, index)
                for index, token_id in enumerate(request.generated_ids)
                if index >= num_logged
            ]
            queue_checkpoint(pipe, self._keys, tokens, None)
            self.journal.logged(request_id, len(request.generated_ids))
        trim_point = self.journal.trim_point()
        if trim_point is not None:
            pipe.xtrim(self._keys.results, minid=trim_point, approximate=True)

    def _ack_finished(self, finished: Sequence[FinishedRequest], pipe: Pipeline) -> None:
        """Requests that ended: their tokens go into their logs (kept for the
        retention from now on), in the transaction that takes their submits
        off the pending list."""
        retention_s = self._settings.redis.log_retention_s
        self._metrics.requests_finished(finished)
        for request in finished:
            tokens = _sampled_tokens(request, self.journal.num_logged(request.request_id))
            queue_checkpoint(pipe, self._keys, tokens, retention_s)
            self.journal.forget(request.request_id)
            entry_id = self._submit_entry_ids.pop(request.request_id, None)
            if entry_id is not None:
                queue_ack(pipe, self._keys, self._keys.requests, entry_id)

    def _reject(
        self, request_id: str, gateway_id: str, code: str, reason: str, pipe: Pipeline
    ) -> None:
        """Tell the gateway the request ended with an error and end its log
        (kept ``log_retention_s`` from now on)."""
        rejection = RequestRejected(request_id=request_id, code=code, message=reason)
        pipe.publish(self._keys.tokens(gateway_id), encode(rejection))
        failed = RequestFailed(request_id=request_id, code=code, message=reason)
        queue_failure(pipe, self._keys, failed, self._settings.redis.log_retention_s)

    async def _join(self, message: WorkerJoined, pipe: Pipeline) -> bool:
        worker_id = message.worker_id
        # A join read from the stream's history, of a worker long gone, is ignored.
        if not await self._redis.exists(self._keys.worker_heartbeat(worker_id)):
            _log.warning("join_of_dead_worker_ignored", worker_id=worker_id)
            return False
        if worker_id in self.core.workers:
            self.lose(worker_id, "rejoined", pipe)
        try:
            self.core.worker_joined(
                worker_id,
                message.num_blocks,
                message.block_size,
                message.max_inflight,
                message.pipeline_depth,
            )
        except SchedulerError as error:
            _log.warning("bad_worker_join", worker_id=worker_id, error=str(error))
            return True
        self._workers_alive.alive(worker_id, self._clock())
        # Whatever is still in the plan stream was meant for an earlier incarnation.
        pipe.xtrim(self._keys.plans(worker_id), maxlen=0, approximate=False)
        _log.info(
            "worker_joined",
            worker_id=worker_id,
            num_blocks=message.num_blocks,
            block_size=message.block_size,
            max_inflight=message.max_inflight,
            pipeline_depth=message.pipeline_depth,
        )
        return True

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
            queue_end(pipe, self._keys, ended, self._settings.redis.log_retention_s)
        self._ack_finished(self.core.cancel(message.request_id), pipe)


def _sampled_tokens(request: FinishedRequest, num_logged: int) -> list[SampledToken]:
    """An ended request's tokens from index ``num_logged`` on, the last one with
    its finish reason when a token ended it."""
    reason = request.finish_reason if request.finish_reason in ("stop", "length") else None
    last = len(request.token_ids) - 1
    return [
        SampledToken(request.request_id, token_id, index, reason if index == last else None)
        for index, token_id in enumerate(request.token_ids)
        if index >= num_logged
    ]
