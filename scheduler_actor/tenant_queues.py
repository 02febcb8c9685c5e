"""Waiting requests per tenant, picked by smallest virtual counter (``fair``)."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_actor.fcfs_queue import FcfsQueue
from scheduler_actor.request import Request
from scheduler_actor.vtc import VirtualTokenCounter


class TenantQueues:
    """One FCFS queue per backlogged tenant.

    The next request comes from the backlogged tenant with the smallest
    counter, FCFS inside it. A tenant that becomes backlogged again has its
    counter lifted to the minimum of the backlogged tenants (or, when none is,
    to the counter of the last tenant that left the backlog), as in VTC; so
    is a tenant passed over because it is at its ``max_in_flight``.
    Choosing scans the backlogged tenants, never the requests.
    """

    __slots__ = ("_last_left_counter", "_queues", "_vtc", "num_waiting")

    def __init__(self, vtc: VirtualTokenCounter) -> None:
        self._vtc = vtc
        self._queues: dict[str, FcfsQueue] = {}
        self._last_left_counter = 0.0
        self.num_waiting = 0

    def push(self, request: Request) -> None:
        """Add a waiting request to its tenant's queue."""
        queue = self._queues.get(request.tenant)
        if queue is None:
            floor = (
                min(self._vtc.counter(tenant) for tenant in self._queues)
                if self._queues
                else self._last_left_counter
            )
            self._vtc.lift(request.tenant, floor)
            queue = self._queues[request.tenant] = FcfsQueue()
        queue.push(request)
        self.num_waiting += 1

    def peek(self, can_run: Callable[[str], bool]) -> Request | None:
        """The head of the backlogged tenant with the smallest counter among
        those that ``can_run`` (not at their ``max_in_flight``)."""
        counter = self._vtc.counter
        best: str | None = None
        best_counter = 0.0
        passed_over: list[str] = []
        for tenant in self._queues:
            if not can_run(tenant):
                passed_over.append(tenant)
                continue
            value = counter(tenant)
            if best is None or value < best_counter:
                best, best_counter = tenant, value
        if best is None:
            return None
        # A tenant held back by its own cap is not owed the service it could
        # not take: like an idle tenant, it must not bank credit meanwhile.
        for tenant in passed_over:
            self._vtc.lift(tenant, best_counter)
        return self._queues[best].peek()

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
            del self._queues[tenant]
            self._last_left_counter = self._vtc.counter(tenant)
