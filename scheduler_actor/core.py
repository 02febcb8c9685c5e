"""The scheduler core: events in, plans out. Pure: no I/O, time from a clock.

Events: ``submit``, ``cancel``, ``worker_joined``, ``worker_lost`` and
``on_result`` (a worker's StepOutput). ``next_plan(worker_id)`` returns the
next StepPlan for that worker, or None when it has nothing to run or already
has ``max_inflight`` plans outstanding. Events that end requests return the
FinishedRequest records to deliver to clients.

No poison pill: a request a worker reports failed ends with "error" and is
never placed again, and a request that was on ``MAX_WORKERS_LOST`` workers
that failed under it ends with "error" instead of going to another one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from scheduler_actor.block_ledger import BlockLedger, PrefixCacheStats
from scheduler_actor.config import SchedulerConfig
from scheduler_actor.errors import (
    DuplicateRequestError,
    DuplicateWorkerError,
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
    UnknownWorkerError,
)
from scheduler_actor.placement import KvRelease, Placements
from scheduler_actor.plan_builder import PlanBuilder
from scheduler_actor.policy import make_policy
from scheduler_actor.prefix_cache import cache_group_of, commit_confirmed, prefix_hit
from scheduler_actor.request import EndReason, FinishedRequest, Request, RequestStatus
from scheduler_actor.tenant_ledger import TenantLedger
from scheduler_actor.vtc import VirtualTokenCounter
from scheduler_actor.worker_state import WorkerState
from shared.messages import (
    FinishReason,
    RequestSpec,
    SamplingParams,
    StepOutput,
    StepPlan,
    TenantLimits,
)
from shared.settings import MAX_INFLIGHT

# A request on this many workers that failed (heartbeat lost, re-joined after a
# crash) while it ran ends with an error: it may be what kills them.
MAX_WORKERS_LOST = 2
WORKERS_LOST_MESSAGE = "the request was on two workers that failed"
# Token ids are hashed as 64-bit integers (prefix_cache.py); the model checks its vocabulary.
MIN_TOKEN_ID, MAX_TOKEN_ID = -(2**63), 2**63 - 1


class Scheduler:
    """All scheduling state of orcapod; one instance per scheduler process."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self.vtc = VirtualTokenCounter(config)
        self.tenants = TenantLedger()
        self._policy = make_policy(config, self.vtc, self.tenants, self._is_preferred)
        self._requests: dict[str, Request] = {}
        self._workers: dict[str, WorkerState] = {}
        self._placements = Placements(self._workers, self._policy, self.tenants, self.vtc)
        self._next_arrival_seq = 0
        self._next_join_seq = 0
        # One counter for all workers, so a result of a lost worker's plan
        # never matches a plan of its next incarnation.
        self._next_step_index = 0
        # What the prefix caches of all workers did, since this core started.
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every live (not yet released) request, by id."""
        return self._requests

    @property
    def workers(self) -> Mapping[str, WorkerState]:
        """Every joined worker, by id."""
        return self._workers

    @property
    def num_waiting(self) -> int:
        """Requests on no worker."""
        return self._policy.num_waiting

    def submit(
        self,
        request_id: str,
        tenant: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        gateway_id: str = "",
        generated_ids: Sequence[int] = (),
        limits: TenantLimits | None = None,
        is_recovered: bool = False,
    ) -> None:
        """Accept a request; raises InvalidRequestError, DuplicateRequestError,
        when workers have joined and none could ever hold prompt + max_tokens,
        RequestTooLargeError, and QueueFullError when ``config.max_waiting``
        requests wait already, or the tenant has its ``limits.max_queued``
        waiting. ``limits`` become the tenant's weight and quotas from now on
        (without them, the configured ones stay). ``generated_ids``: tokens
        already sent to the client (a request recovered by a new scheduler);
        it continues after them. A recovered request was accepted once
        already: neither queue limit refuses it again."""
        if not prompt_ids:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
        if min(prompt_ids) < MIN_TOKEN_ID or max(prompt_ids) > MAX_TOKEN_ID:
            raise InvalidRequestError(f"request {request_id!r} has a token id beyond 64 bits")
        if sampling.max_tokens < 1:
            raise InvalidRequestError(f"request {request_id!r} has max_tokens < 1")
        if len(generated_ids) >= sampling.max_tokens:
            raise InvalidRequestError(f"request {request_id!r} has all its tokens already")
        if request_id in self._requests:
            raise DuplicateRequestError(f"request {request_id!r} is already live")
        num_tokens = len(prompt_ids) + sampling.max_tokens
        if self._workers and not any(w.ledger.can_hold(num_tokens) for w in self._workers.values()):
            raise RequestTooLargeError(
                f"request {request_id!r} needs {num_tokens} K/V slots, more than any worker has"
            )
        # Before the tenant's limits are recorded: a tenant refused here has
        # nothing waiting or running, and the ledger keeps no entry for it.
        if not is_recovered and self._is_full():
            # Not how many: other tenants' queues are none of this client's business.
            raise QueueFullError("the service is at capacity; retry later")
        if limits is not None:
            self.vtc.set_weight(tenant, limits.weight)
            self.tenants.set_limits(tenant, limits)
        if not is_recovered and not self.tenants.can_queue(tenant):
            raise QueueFullError(
                f"tenant {tenant!r} already has {self.tenants.num_waiting(tenant)} requests "
                f"waiting (its max_queued is {self.tenants.max_queued(tenant)}); retry later"
            )
        request = Request(
            request_id=request_id,
            tenant=tenant,
            prompt_ids=prompt_ids,
            sampling=sampling,
            arrival_s=self._clock(),
            arrival_seq=self._next_arrival_seq,
            gateway_id=gateway_id,
            generated_ids=list(generated_ids),
            cache_group=cache_group_of(tenant, limits.cache_group if limits else None),
        )
        self._next_arrival_seq += 1
        self._requests[request_id] = request
        self._placements.move(request, RequestStatus.WAITING)

    def cancel(self, request_id: str) -> list[FinishedRequest]:
        """Cancel a live request (a no-op for unknown or finished ones). Returns
        its record and, under ``request``, any batch this completes."""
        request = self._requests.get(request_id)
        if request is None or request.status is RequestStatus.FINISHED:
            return []
        worker = self._workers[request.worker_id] if request.worker_id is not None else None
        request.finish_reason = "cancelled"
        # A placed request's K/V is released in its worker's next plan.
        self._placements.move(request, RequestStatus.FINISHED)
        released = [self._release(request)]
        if worker is not None:
            released += self._release_batch_if_done(worker)
        return released

    def move_to_gateway(self, request_id: str, gateway_id: str) -> None:
        """A live request is now served by ``gateway_id`` (a resume there); a no-op
        for requests that are not live."""
        request = self._requests.get(request_id)
        if request is not None:
            request.gateway_id = gateway_id

    def worker_joined(
        self,
        worker_id: str,
        num_blocks: int,
        block_size: int,
        max_inflight: int = 1,
        pipeline_depth: int = 1,
    ) -> None:
        """Register a worker and its K/V budget (``pipeline_depth``: the stages of a
        worker group, whose requests are each in one outstanding plan at most)."""
        if worker_id in self._workers:
            raise DuplicateWorkerError(f"worker {worker_id!r} already joined")
        if num_blocks < 1 or block_size < 1 or not 1 <= max_inflight <= MAX_INFLIGHT:
            raise InvalidRequestError(
                f"num_blocks and block_size must be >= 1 and max_inflight 1 to {MAX_INFLIGHT}"
            )
        if pipeline_depth < 1:
            raise InvalidRequestError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
        self._workers[worker_id] = WorkerState(
            worker_id=worker_id,
            join_seq=self._next_join_seq,
            max_inflight=max_inflight,
            pipeline_depth=pipeline_depth,
            ledger=BlockLedger(
                num_blocks, block_size, self.config.prefix_caching, self.prefix_cache_stats
            ),
        )
        self._next_join_seq += 1

    def worker_lost(self, worker_id: str, failed: bool = True) -> list[FinishedRequest]:
        """Forget a worker: its requests wait again, to be recomputed from the
        prompt plus the tokens already generated; results it held are released.

        ``failed``: the worker died or vanished (not a clean leave); a request
        that was on ``MAX_WORKERS_LOST`` such workers ends with "error" (its
        record is returned) instead of going to another one."""
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorkerError(worker_id)
        # Its K/V, held batch included, is gone with it.
        ended = [self._release(request) for request in worker.held]
        for request in sorted(worker.placed.values(), key=_arrival_seq):
            request.num_workers_lost += int(failed)
            if request.num_workers_lost >= MAX_WORKERS_LOST:
                ended.append(
                    self._end_with_error(request, WORKERS_LOST_MESSAGE, KvRelease.BY_WORKER)
                )
            else:
                self._placements.move(request, RequestStatus.WAITING, KvRelease.BY_WORKER)
        del self._workers[worker_id]
        return ended

    def next_plan(self, worker_id: str) -> StepPlan | None:
        """The worker's next iteration, or None when it has nothing to run or
        ``max_inflight`` plans are already outstanding."""
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorkerError(worker_id)
        if not worker.can_plan():
            return None
        builder = PlanBuilder(
            worker, self._next_step_index, self.config.epoch, self._placements, self.config.overlap
        )
        self._policy.fill(builder)
        plan = builder.build()
        if plan is not None:
            self._next_step_index += 1
            if plan.new_requests:
                self._note_first_placements(plan.new_requests)
        return plan

    def _note_first_placements(self, placed: Sequence[RequestSpec]) -> None:
        """When each request was placed for the first time (its queue time ends)."""
        now_s = self._clock()
        for spec in placed:
            request = self._requests[spec.request_id]
            if request.first_scheduled_s is None:
                request.first_scheduled_s = now_s

    def on_result(self, output: StepOutput) -> list[FinishedRequest]:
        """Record a step's tokens; returns the requests whose results are
        released now. Results of unknown workers or plans are stale: ignored."""
        worker = self._workers.get(output.worker_id)
        if worker is None:
            return []
        batch = worker.outstanding.pop(output.step_index, None)
        if batch is None:
            return []
        # Locals: this loop runs for every token of every step.
        worker_id, placed, requests = worker.worker_id, RequestStatus.PLACED, self._requests
        ledger = worker.ledger
        caching = ledger.prefix_caching
        for planned in batch:
            if planned.status is placed and planned.worker_id == worker_id:
                planned.num_inflight -= 1
        released: list[FinishedRequest] = []
        for failure in output.failed:
            request = requests.get(failure.request_id)
            if request is not None and request.status is placed and request.worker_id == worker_id:
                released += self._fail(worker, request, failure.message)
        # One VTC charge per tenant per step, not one per token.
        num_tokens_by_tenant: dict[str, int] = {}
        for token in output.tokens:
            request = requests.get(token.request_id)
            if request is None or request.status is not placed or request.worker_id != worker_id:
                continue
            generated_ids = request.generated_ids
            if token.index != len(generated_ids):
                continue
            generated_ids.append(token.token_id)
            if len(generated_ids) == 1:
                request.first_token_s = self._clock()
            # The placement's first token: its whole context is written (the
            # rest is cached when it leaves the worker: Placements.move).
            if caching and len(generated_ids) == (
                len(request.context_ids) - len(request.prompt_ids) + 1
            ):
                commit_confirmed(ledger, request)
            tenant = request.tenant
            num_tokens_by_tenant[tenant] = num_tokens_by_tenant.get(tenant, 0) + 1
            reason: FinishReason | None = token.finish_reason
            if reason is None and len(generated_ids) >= request.sampling.max_tokens:
                reason = "length"
            if reason is not None:
                released += self._finish(worker, request, reason)
        for tenant, num_tokens in num_tokens_by_tenant.items():
            self.vtc.charge(tenant, 0, num_tokens)
        return released

    def _fail(self, worker: WorkerState, request: Request, error: str) -> list[FinishedRequest]:
        """The worker ended the request with an error (and freed its blocks): it
        ends here too, never placed again; it holds no batch back."""
        return [
            self._end_with_error(request, error, KvRelease.BY_WORKER),
            *self._release_batch_if_done(worker),
        ]

    def _end_with_error(self, request: Request, error: str, kv: KvRelease) -> FinishedRequest:
        request.finish_reason = "error"
        request.error = error
        self._placements.move(request, RequestStatus.FINISHED, kv)
        return self._release(request)

    def _finish(
        self, worker: WorkerState, request: Request, reason: EndReason
    ) -> list[FinishedRequest]:
        # The worker frees a finished request's blocks itself.
        request.finish_reason = reason
        if self._policy.holds_results_until_batch_end:
            self._placements.move(request, RequestStatus.FINISHED, KvRelease.AT_BATCH_END)
            return self._release_batch_if_done(worker)
        self._placements.move(request, RequestStatus.FINISHED, KvRelease.BY_WORKER)
        return [self._release(request)]

    def _release_batch_if_done(self, worker: WorkerState) -> list[FinishedRequest]:
        return [self._release(request) for request in self._placements.end_batch_if_done(worker)]

    def _release(self, request: Request) -> FinishedRequest:
        del self._requests[request.request_id]
        assert request.finish_reason is not None
        return FinishedRequest(
            request_id=request.request_id,
            tenant=request.tenant,
            token_ids=request.generated_ids,
            finish_reason=request.finish_reason,
            arrival_s=request.arrival_s,
            finish_s=self._clock(),
            num_preemptions=request.num_preemptions,
            error=request.error,
            gateway_id=request.gateway_id,
            num_prompt_tokens=len(request.prompt_ids),
            first_scheduled_s=request.first_scheduled_s,
            first_token_s=request.first_token_s,
        )

    def _is_full(self) -> bool:
        """Whether ``config.max_waiting`` requests wait (all tenants together)."""
        max_waiting = self.config.max_waiting
        return max_waiting is not None and self.num_waiting >= max_waiting

    def _is_preferred(self, worker: WorkerState, request: Request) -> bool:
        """The routing rule: among the workers that could ever hold the
        request, the one caching its longest prefix (one block at least),
        unless that one runs more than ``config.routing_slack`` requests beyond
        the least loaded of them or has too few free blocks for the request's
        context now; otherwise (and when no worker caches any of it) the one
        with the most free K/V. Ties by fewest placed requests, then by join
        order."""
        workers = self._workers
        if len(workers) == 1:
            return worker.ledger.can_hold(request.num_max_context_tokens)
        num_tokens = request.num_max_context_tokens
        candidates = [w for w in workers.values() if w.ledger.can_hold(num_tokens)]
        if not candidates:
            return False
        least_placed = min(len(candidate.placed) for candidate in candidates)
        num_context_tokens = len(request.prompt_ids) + len(request.generated_ids)
        best: WorkerState | None = None
        best_key = (0, 0, 0, 0)
        for candidate in candidates:
            ledger = candidate.ledger
            num_hit_blocks = 0
            if (
                self.config.cache_aware_routing
                and len(candidate.placed) <= least_placed + self.config.routing_slack
            ):
                hit = prefix_hit(ledger, request)
                needed = ledger.blocks_for(num_context_tokens) - len(hit) + ledger.num_revived(hit)
                num_hit_blocks = len(hit) if needed <= ledger.num_free else 0
            key = (
                num_hit_blocks * ledger.block_size,
                ledger.num_free_tokens,
                -len(candidate.placed),
                -candidate.join_seq,
            )
            if best is None or key > best_key:
                best, best_key = candidate, key
        return best is worker


def _arrival_seq(request: Request) -> int:
    return request.arrival_seq
