"""Building one StepPlan: the block-exact mechanics every policy shares.

A policy decides *who* runs; the builder does the bookkeeping of *running*
them: placing a request on the worker, from its longest cached prefix on,
and preempting it (both through ``Placements.move``), allocating K/V blocks
on demand and granting them in the plan (check then act:
``can_decode``/``decode``, ``num_prefill_fits``/``prefill``,
``blocks_to_place``/``place``, ``can_reserve``/``reserve``).
"""

from __future__ import annotations

import math

from scheduler_actor.config import SchedulerConfig
from scheduler_actor.placement import Placements
from scheduler_actor.prefix_cache import prefix_hit
from scheduler_actor.request import Request, RequestStatus
from scheduler_actor.worker_state import WorkerState
from shared.messages import PrefillChunk, RequestSpec, StepPlan


def step_token_limits(config: SchedulerConfig, worker: WorkerState) -> tuple[int, int]:
    """A plan's new tokens at most, and its largest prompt chunk, on ``worker``
    (under ``fair``): the config's, and on a worker group of several stages at
    most ``pipeline_token_budget`` each. A group's plans go through its stages
    one behind the other, so each stage waits whenever the plan it gets next
    took longer in the stage before: one long prompt chunk among decodes is a
    bubble as long as the difference in every other stage. Small plans keep
    them alike (docs/performance.md, *Worker groups*)."""
    if worker.pipeline_depth == 1:
        return config.token_budget, config.max_chunk_tokens
    budget = min(config.token_budget, config.pipeline_token_budget)
    return budget, min(config.max_chunk_tokens, budget)


class PlanBuilder:
    """Accumulates one iteration of one worker."""

    __slots__ = (
        "block_grants",
        "decode_request_ids",
        "epoch",
        "max_continuing",
        "max_plans_per_request",
        "new_requests",
        "num_continuing",
        "num_new_tokens",
        "placed_ids",
        "placements",
        "prefill_chunks",
        "scheduled",
        "scheduled_ids",
        "step_index",
        "worker",
    )

    def __init__(
        self,
        worker: WorkerState,
        step_index: int,
        epoch: int,
        placements: Placements,
        overlap: bool = True,
    ) -> None:
        self.worker = worker
        # With overlap a request may be in every outstanding plan of its
        # worker (its lookahead; one in a pipeline); without, in one at a time.
        self.max_plans_per_request = worker.max_plans_per_request if overlap else 1
        # A pipeline's running requests spread over its stages (Orca's Figure 8): a
        # plan goes on with at most its share of them, so the plans of the other
        # stages get the rest (a group fed one plan at a time has one batch);
        # admissions come on top, up to the batch size.
        self.max_continuing: int | None = None
        num_batches = min(worker.pipeline_depth, worker.max_inflight)
        if worker.pipeline_depth > 1 and num_batches > 1:
            self.max_continuing = max(1, math.ceil(len(worker.placed) / num_batches))
        self.num_continuing = 0
        self.placed_ids: set[str] = set()  # placed on the worker by this plan
        # Every placement and preemption is recorded at once, so a policy's
        # next `can_run` (or VTC counter) in the same step already counts it.
        self.placements = placements
        self.step_index = step_index
        self.epoch = epoch
        self.new_requests: list[RequestSpec] = []
        self.prefill_chunks: list[PrefillChunk] = []
        self.decode_request_ids: list[str] = []
        self.block_grants: dict[str, list[int]] = {}
        self.scheduled: list[Request] = []
        self.scheduled_ids: set[str] = set()
        self.num_new_tokens = 0

    @property
    def num_scheduled(self) -> int:
        """Requests in this plan so far."""
        return len(self.scheduled)

    def blocks_to_place(self, request: Request, num_tokens: int) -> int:
        """Of this worker's free (and evictable) blocks, how many placing a
        waiting request with ``num_tokens`` slots uses: its blocks less those
        its cached prefix already holds, plus the cached ones nobody holds."""
        ledger = self.worker.ledger
        hit = prefix_hit(ledger, request)
        return ledger.blocks_for(num_tokens) - len(hit) + ledger.num_revived(hit)

    def place(self, request: Request) -> None:
        """Put a waiting request on this worker; its context is recomputed from
        the prompt plus whatever it generated before, after its longest
        prefix cached here (whose blocks it now holds too)."""
        ledger = self.worker.ledger
        hit = prefix_hit(ledger, request)
        ledger.acquire(hit)
        request.block_ids = hit
        request.num_cached_tokens = len(hit) * ledger.block_size
        request.num_committed_blocks = len(hit)
        if ledger.prefix_caching:
            stats = ledger.stats
            stats.num_queries += 1
            stats.num_hits += bool(hit)
            stats.num_query_tokens += len(request.prompt_ids) + len(request.generated_ids)
            stats.num_hit_tokens += request.num_cached_tokens
        self.placements.move(request, self.worker)
        self.placed_ids.add(request.request_id)
        request.num_prefill_planned = request.num_cached_tokens
        if hit:
            self.block_grants[request.request_id] = list(hit)
        self.new_requests.append(
            RequestSpec(
                request_id=request.request_id,
                num_prompt_tokens=len(request.context_ids),
                sampling=request.sampling,
                num_generated=len(request.generated_ids),
                gateway_id=request.gateway_id,
                num_cached_tokens=request.num_cached_tokens,
            )
        )

    def can_continue(self, request: Request) -> bool:
        """Whether the placed request's next step may be planned in this plan."""
        if self.max_continuing is not None and self.num_continuing >= self.max_continuing:
            return False
        return request.can_continue(self.max_plans_per_request)

    def can_reserve(self, request: Request, num_tokens: int) -> bool:
        """Whether ``num_tokens`` slots can be reserved up front on this worker
        for a waiting request."""
        return self.worker.ledger.can_allocate(self.blocks_to_place(request, num_tokens))

    def reserve(self, request: Request, num_tokens: int) -> None:
        """Reserve ``num_tokens`` slots for a request just placed (orca, request)."""
        self._grant(request, self.worker.ledger.blocks_for(num_tokens) - request.num_blocks)

    def num_prefill_fits(self, request: Request, num_tokens: int) -> int:
        """Largest prompt chunk of at most ``num_tokens`` whose blocks are free."""
        ledger = self.worker.ledger
        capacity = (request.num_blocks + ledger.num_free) * ledger.block_size
        return max(0, min(num_tokens, capacity - request.num_tokens_planned))

    def prefill(self, request: Request, num_tokens: int) -> None:
        """Run the next ``num_tokens`` of the request's context in this step."""
        assert 0 < num_tokens <= len(request.context_ids) - request.num_prefill_planned
        self._grant(request, self._blocks_to_grow(request, num_tokens))
        start = request.num_prefill_planned
        self.prefill_chunks.append(
            PrefillChunk(
                request_id=request.request_id,
                token_ids=request.context_ids[start : start + num_tokens],
                start_position=start,
            )
        )
        request.num_prefill_planned += num_tokens
        self._schedule(request, num_tokens)

    def can_decode(self, request: Request) -> bool:
        """Whether the blocks for one more token are free (or already held)."""
        ledger = self.worker.ledger
        needed = ledger.blocks_for(request.num_tokens_planned + 1) - len(request.block_ids)
        return needed <= 0 or ledger.can_allocate(needed)

    def decode(self, request: Request) -> None:
        """Decode one token of the request in this step."""
        self._grant(request, self._blocks_to_grow(request, 1))
        request.num_decodes_planned += 1
        self.decode_request_ids.append(request.request_id)
        self._schedule(request, 1)

    def preempt(self, request: Request) -> None:
        """Take a placed request off the worker (recompute later): free its
        blocks now and tell the worker to free them before this step."""
        assert request.status is RequestStatus.PLACED and request.worker_id == self.worker.worker_id
        assert request.num_inflight == 0 and request.request_id not in self.scheduled_ids
        self.placements.move(request, RequestStatus.WAITING)
        request.num_preemptions += 1

    def build(self) -> StepPlan | None:
        """The finished plan, or None when nothing runs (releases then wait for
        the next plan)."""
        worker = self.worker
        # Each request placed in this step runs in it (the prompt's VTC charge
        # relies on it: a placed request has iterations).
        assert all(spec.request_id in self.scheduled_ids for spec in self.new_requests)
        if not self.scheduled:
            return None
        for request in self.scheduled:
            request.num_inflight += 1
            request.num_iterations += 1
        worker.outstanding[self.step_index] = self.scheduled
        # Cancels and preemptions since the last plan: the ledger already
        # freed their blocks, which is exact because the worker releases
        # before it runs this step.
        released_request_ids, worker.pending_release_ids = worker.pending_release_ids, []
        return StepPlan(
            worker_id=worker.worker_id,
            epoch=self.epoch,
            step_index=self.step_index,
            new_requests=self.new_requests,
            prefill_chunks=self.prefill_chunks,
            decode_request_ids=self.decode_request_ids,
            released_request_ids=released_request_ids,
            block_grants=self.block_grants,
        )

    def _blocks_to_grow(self, request: Request, num_tokens: int) -> int:
        ledger = self.worker.ledger
        return ledger.blocks_for(request.num_tokens_planned + num_tokens) - len(request.block_ids)

    def _grant(self, request: Request, num_blocks: int) -> None:
        """Give the request ``num_blocks`` more blocks, in this plan."""
        if num_blocks > 0:
            block_ids = self.worker.ledger.allocate(num_blocks)
            request.block_ids += block_ids
            self.block_grants.setdefault(request.request_id, []).extend(block_ids)

    def _schedule(self, request: Request, num_tokens: int) -> None:
        assert request.request_id not in self.scheduled_ids
        if request.request_id not in self.placed_ids:
            self.num_continuing += 1  # placed before this plan
        self.scheduled.append(request)
        self.scheduled_ids.add(request.request_id)
        self.num_new_tokens += num_tokens
