"""Where each request is (waiting, on a worker, finished), and the one method that moves it.

A request's placement is held in several records: its ``status`` and
``worker_id``, its worker's ``placed`` map (or ``held`` batch), that worker's
``BlockLedger`` (which keeps the blocks it wrote cached as it leaves), the
policy's waiting queue, the tenant ledger's counts, and the releases the
worker is told of before its next step. ``Placements.move``
changes them all together, so they cannot disagree; nothing else changes
them. The prompt's VTC charge is made here too: when a request is placed for
the first time. See docs/scheduler.md.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING

from scheduler_actor.prefix_cache import commit_confirmed
from scheduler_actor.request import Request, RequestStatus
from scheduler_actor.tenant_ledger import TenantLedger
from scheduler_actor.vtc import VirtualTokenCounter
from scheduler_actor.worker_state import WorkerState

if TYPE_CHECKING:
    # Only a type here: the policies import the plan builder, which imports this.
    from scheduler_actor.policy import Policy


class KvRelease(enum.Enum):
    """What becomes of a request's K/V on its worker when it leaves that worker."""

    # The worker still holds it: its next plan releases it (preempted, cancelled).
    TELL_WORKER = enum.auto()
    # The worker freed it itself (it finished or failed the request) or is gone.
    BY_WORKER = enum.auto()
    # As BY_WORKER, but the blocks stay counted until the request's batch ends
    # (``request`` policy: results are released with the whole batch).
    AT_BATCH_END = enum.auto()


class Placements:
    """Moves requests between waiting, the workers and finished."""

    __slots__ = ("_policy", "_tenants", "_vtc", "_workers")

    def __init__(
        self,
        workers: Mapping[str, WorkerState],
        policy: Policy,
        tenants: TenantLedger,
        vtc: VirtualTokenCounter,
    ) -> None:
        self._workers = workers
        self._policy = policy
        self._tenants = tenants
        self._vtc = vtc

    def move(
        self,
        request: Request,
        to: WorkerState | RequestStatus,
        kv: KvRelease = KvRelease.TELL_WORKER,
    ) -> None:
        """Move ``request`` to a worker (from WAITING: placed there), to WAITING
        (a new request; or from a worker: recomputed later from its prompt and
        the tokens generated so far) or to FINISHED (from either). ``kv``: what
        becomes of its K/V when it leaves a worker."""
        source = request.status
        assert source is not RequestStatus.FINISHED, request.request_id
        assert to is not RequestStatus.PLACED, "to place a request, move it to a WorkerState"
        tenant = request.tenant
        if source is RequestStatus.WAITING:
            if isinstance(to, WorkerState):
                self._policy.dequeue(request)
            else:
                self._policy.discard(request)
        elif source is RequestStatus.PLACED:
            self._leave_worker(request, kv)
        if isinstance(to, WorkerState):
            assert source is RequestStatus.WAITING, request.request_id
            self._place(request, to)
        elif to is RequestStatus.WAITING:
            assert source is not RequestStatus.WAITING, request.request_id
            request.status = RequestStatus.WAITING
            if source is RequestStatus.NEW:
                self._tenants.queued(tenant)
            else:
                self._tenants.unplaced(tenant)
            self._policy.enqueue(request)
        else:
            assert source is not RequestStatus.NEW, request.request_id
            request.status = RequestStatus.FINISHED
            if source is RequestStatus.WAITING:
                self._tenants.left_waiting(tenant)
            else:
                self._tenants.left_running(tenant)

    def end_batch_if_done(self, worker: WorkerState) -> list[Request]:
        """The worker's held batch once none of it runs any more: its blocks
        are freed now and its requests returned, to be released."""
        if worker.placed or not worker.held:
            return []
        held, worker.held = worker.held, []
        for request in held:
            worker.ledger.release(request.block_ids)
            request.block_ids = []
        return held

    def _place(self, request: Request, worker: WorkerState) -> None:
        # Never run before: the first placement, where the prompt is charged.
        # A request placed here always runs in the plan being built, so a
        # preempted or requeued one has iterations and is never charged again.
        is_first = request.num_iterations == 0
        request.status = RequestStatus.PLACED
        request.worker_id = worker.worker_id
        request.context_ids = request.prompt_ids + request.generated_ids
        worker.placed[request.request_id] = request
        self._tenants.placed(request.tenant)
        if is_first:
            # Only the prompt tokens computed are charged: a cached one is
            # work done (and charged) once before, by this tenant's cache group.
            num_computed = len(request.prompt_ids) - min(
                request.num_cached_tokens, len(request.prompt_ids)
            )
            self._vtc.charge(request.tenant, num_computed, 0)

    def _leave_worker(self, request: Request, kv: KvRelease) -> None:
        assert request.worker_id is not None
        worker = self._workers[request.worker_id]
        del worker.placed[request.request_id]
        request.worker_id = None
        # What its returned steps wrote stays cached after it (a next turn's prefix).
        commit_confirmed(worker.ledger, request)
        if kv is KvRelease.AT_BATCH_END:
            worker.held.append(request)
        else:
            worker.ledger.release(request.block_ids)
            request.block_ids = []
            if kv is KvRelease.TELL_WORKER:
                worker.pending_release_ids.append(request.request_id)
        # What a placement planned is gone with it; a later one starts over.
        request.context_ids = []
        request.num_prefill_planned = 0
        request.num_decodes_planned = 0
        request.num_inflight = 0
        request.num_cached_tokens = 0
        request.num_committed_blocks = 0
