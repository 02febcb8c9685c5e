"""Waiting requests per tenant, picked by smallest virtual counter (``fair``)."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_actor.fcfs_queue import PerTenantQueues
from scheduler_actor.request import Request
from scheduler_actor.vtc import VirtualTokenCounter


class TenantQueues(PerTenantQueues):
    """One FCFS queue per backlogged tenant.

    The next request comes from the backlogged tenant with the smallest
    counter, FCFS inside it. A tenant that becomes backlogged again has its
    counter lifted to the minimum of the backlogged tenants (or, when none is,
    to the counter of the last tenant that left the backlog), as in VTC; so
    is a tenant passed over because it is at its ``max_in_flight``.
    Choosing scans the backlogged tenants, never the requests.
    """

    __slots__ = ("_last_left_counter", "_vtc")

    def __init__(self, vtc: VirtualTokenCounter) -> None:
        super().__init__()
        self._vtc = vtc
        self._last_left_counter = 0.0

    def _tenant_backlogged(self, tenant: str) -> None:
        floor = (
            min(self._vtc.counter(other) for other in self._queues)
            if self._queues
            else self._last_left_counter
        )
        self._vtc.lift(tenant, floor)

    def _tenant_left(self, tenant: str) -> None:
        self._last_left_counter = self._vtc.counter(tenant)

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
