"""Waiting requests in arrival order (``request`` and ``orca``)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from scheduler_actor.config import SchedulerConfig
from scheduler_actor.policy import IsPreferred
from scheduler_actor.request import Request, RequestStatus
from scheduler_actor.tenant_ledger import TenantLedger


class FcfsQueue:
    """A heap by arrival sequence; cancelled entries are dropped lazily, so
    every operation is O(log n) and nothing scans the pool."""

    __slots__ = ("_heap", "num_waiting")

    def __init__(self) -> None:
        self._heap: list[tuple[int, Request]] = []
        self.num_waiting = 0

    def push(self, request: Request) -> None:
        """Add a waiting request (new, preempted or from a lost worker)."""
        heapq.heappush(self._heap, (request.arrival_seq, request))
        self.num_waiting += 1

    def peek(self) -> Request | None:
        """The earliest waiting request, if any."""
        heap = self._heap
        while heap and heap[0][1].status is not RequestStatus.WAITING:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def pop(self, request: Request) -> None:
        """Remove ``request``, which ``peek`` just returned."""
        assert self._heap and self._heap[0][1] is request
        heapq.heappop(self._heap)
        self.num_waiting -= 1

    def discard(self, request: Request) -> None:
        """Forget a waiting request that is being cancelled (its entry goes
        when it reaches the top)."""
        self.num_waiting -= 1


class PerTenantQueues:
    """One FcfsQueue per backlogged tenant; subclasses choose which head is next
    (``peek``) and may act when a tenant joins or leaves the backlog."""

    __slots__ = ("_queues", "num_waiting")

    def __init__(self) -> None:
        self._queues: dict[str, FcfsQueue] = {}
        self.num_waiting = 0

    def push(self, request: Request) -> None:
        """Add a waiting request (new, preempted or from a lost worker)."""
        queue = self._queues.get(request.tenant)
        if queue is None:
            self._tenant_backlogged(request.tenant)
            queue = self._queues[request.tenant] = FcfsQueue()
        queue.push(request)
        self.num_waiting += 1

    def pop(self, request: Request) -> None:
        """Remove ``request``, which ``peek`` just returned."""
        self._queues[request.tenant].pop(request)
        self._after_removal(request.tenant)

    def discard(self, request: Request) -> None:
        """Forget a waiting request that is being cancelled."""
        self._queues[request.tenant].discard(request)
        self._after_removal(request.tenant)

    def _after_removal(self, tenant: str) -> None:
        self.num_waiting -= 1
        if self._queues[tenant].num_waiting == 0:
            # Entries of cancelled requests still in its heap go with it.
            del self._queues[tenant]
            self._tenant_left(tenant)

    def _tenant_backlogged(self, tenant: str) -> None:
        """``tenant`` had nothing waiting and now has a request."""

    def _tenant_left(self, tenant: str) -> None:
        """``tenant`` has nothing waiting any more."""


class ArrivalOrderQueue(PerTenantQueues):
    """All waiting requests in arrival order, one FcfsQueue per tenant, so the
    requests of a tenant at its ``max_in_flight`` can be passed over without
    moving them: ``peek`` takes the earliest head among the tenants that may
    run more. It scans the backlogged tenants, never the requests."""

    __slots__ = ()

    def peek(self, can_run: Callable[[str], bool]) -> Request | None:
        """The earliest waiting request of a tenant that ``can_run``, if any."""
        best: Request | None = None
        for tenant, queue in self._queues.items():
            if not can_run(tenant):
                continue
            head = queue.peek()
            if head is not None and (best is None or head.arrival_seq < best.arrival_seq):
                best = head
        return best


class ArrivalOrderPolicyBase:
    """The waiting-room half of the ``request`` and ``orca`` policies: arrival
    order over every tenant that may run more. Subclasses add ``fill`` (who
    runs each step)."""

    holds_results_until_batch_end = False

    def __init__(
        self, config: SchedulerConfig, tenants: TenantLedger, is_preferred: IsPreferred
    ) -> None:
        self._config = config
        self._tenants = tenants
        self._is_preferred = is_preferred
        self._queue = ArrivalOrderQueue()

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted."""
        return self._queue.num_waiting

    def enqueue(self, request: Request) -> None:
        """Add a waiting request."""
        self._queue.push(request)

    def dequeue(self, request: Request) -> None:
        """Take out the head ``fill`` just chose."""
        self._queue.pop(request)

    def discard(self, request: Request) -> None:
        """Forget a cancelled waiting request."""
        self._queue.discard(request)
