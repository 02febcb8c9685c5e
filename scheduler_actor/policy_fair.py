"""``fair`` (the default): token budget, chunked prefill, paged K/V on demand,
preemption by recompute, and VTC fairness between tenants.

Each step: decodes first (one token each), then prompt chunks of requests
already placed, then new admissions, until ``token_budget`` new tokens
(``pipeline_token_budget`` on a worker group of several stages) or
``max_batch_size`` requests. A decode that cannot get a block preempts a
victim from the tenant with the most service (latest arrival first). A new
request is admitted only if the free blocks, less what the placed requests
still need to finish their prompts, hold its whole context (less its cached
prefix, whose blocks it shares; see ``PlanBuilder.blocks_to_place``): prompts then never
wait on each other forever, and only decodes ever preempt. A tenant at its
``max_in_flight`` is passed over at admission; the others are admitted.
"""

from __future__ import annotations

from scheduler_actor.config import SchedulerConfig
from scheduler_actor.plan_builder import PlanBuilder, step_token_limits
from scheduler_actor.policy import IsPreferred
from scheduler_actor.request import Request, RequestStatus
from scheduler_actor.tenant_ledger import TenantLedger
from scheduler_actor.tenant_queues import TenantQueues
from scheduler_actor.vtc import VirtualTokenCounter


class FairPolicy:
    """Iteration-level scheduling with VTC admission between tenants."""

    holds_results_until_batch_end = False

    def __init__(
        self,
        config: SchedulerConfig,
        vtc: VirtualTokenCounter,
        tenants: TenantLedger,
        is_preferred: IsPreferred,
    ) -> None:
        self._config = config
        self._vtc = vtc
        self._tenants = tenants
        self._is_preferred = is_preferred
        self._queues = TenantQueues(vtc)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, all tenants together."""
        return self._queues.num_waiting

    def enqueue(self, request: Request) -> None:
        """Add a waiting request to its tenant's queue."""
        self._queues.push(request)

    def dequeue(self, request: Request) -> None:
        """Take out the head ``fill`` just chose."""
        self._queues.pop(request)

    def discard(self, request: Request) -> None:
        """Forget a cancelled waiting request."""
        self._queues.discard(request)

    def fill(self, builder: PlanBuilder) -> None:
        """Decodes, then prompt chunks, then admissions."""
        budget, max_chunk = step_token_limits(self._config, builder.worker)
        self._decodes(builder, budget)
        num_pending_blocks = self._prefills(builder, budget, max_chunk)
        self._admit(builder, num_pending_blocks, budget, max_chunk)

    def _decodes(self, builder: PlanBuilder, budget: int) -> None:
        config = self._config
        for request in list(builder.worker.placed.values()):
            if builder.num_scheduled >= config.max_batch_size:
                return
            if builder.num_new_tokens >= budget:
                return
            if request.status is not RequestStatus.PLACED:
                continue  # preempted earlier in this loop
            if not (builder.can_continue(request) and request.wants_decode()):
                continue
            while not builder.can_decode(request):
                victim = self._victim(builder)
                if victim is None:
                    break
                builder.preempt(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.PLACED and builder.can_decode(request):
                builder.decode(request)

    def _victim(self, builder: PlanBuilder) -> Request | None:
        """The placed request of the tenant with the most service, latest
        arrival first, among those not inside a plan."""
        counter = self._vtc.counter
        scheduled_ids = builder.scheduled_ids
        best: Request | None = None
        best_key = (0.0, 0)
        for request in builder.worker.placed.values():
            if request.num_inflight or request.request_id in scheduled_ids:
                continue
            key = (counter(request.tenant), request.arrival_seq)
            if best is None or key > best_key:
                best, best_key = request, key
        return best

    def _prefills(self, builder: PlanBuilder, budget: int, max_chunk: int) -> int:
        """Continue placed prompts; return the blocks they still need after
        this step."""
        config = self._config
        ledger = builder.worker.ledger
        num_pending_blocks = 0
        for request in builder.worker.placed.values():
            if not request.wants_prefill():
                continue
            room = min(budget - builder.num_new_tokens, max_chunk)
            if (
                room > 0
                and builder.num_scheduled < config.max_batch_size
                and builder.can_continue(request)
                and request.request_id not in builder.scheduled_ids
            ):
                remaining = len(request.context_ids) - request.num_prefill_planned
                num_tokens = builder.num_prefill_fits(request, min(room, remaining))
                if num_tokens > 0:
                    builder.prefill(request, num_tokens)
            num_pending_blocks += max(
                0, ledger.blocks_for(len(request.context_ids)) - request.num_blocks
            )
        return num_pending_blocks

    def _admit(
        self, builder: PlanBuilder, num_pending_blocks: int, budget: int, max_chunk: int
    ) -> None:
        config = self._config
        worker = builder.worker
        ledger = worker.ledger
        queues = self._queues
        can_run = self._tenants.can_run
        while (
            builder.num_scheduled < config.max_batch_size
            and len(worker.placed) < config.max_batch_size
            and builder.num_new_tokens < budget
        ):
            request = queues.peek(can_run)
            if request is None or not self._is_preferred(worker, request):
                return
            num_context_tokens = len(request.prompt_ids) + len(request.generated_ids)
            if builder.blocks_to_place(request, num_context_tokens) > (
                ledger.num_free - num_pending_blocks
            ):
                return
            builder.place(request)
            room = min(budget - builder.num_new_tokens, max_chunk)
            num_tokens = min(room, num_context_tokens - request.num_prefill_planned)
            builder.prefill(request, num_tokens)
            num_pending_blocks += ledger.blocks_for(num_context_tokens) - request.num_blocks
