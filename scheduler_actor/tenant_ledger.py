"""Per tenant: its quotas (from its latest submit) and how many requests wait and run.

Pure bookkeeping. ``Placements.move`` reports every move of a request
between waiting, running (placed on a worker) and gone; the core asks
``can_queue`` at submit and the policies ask ``can_run`` before they
place a request, so a tenant at its ``max_in_flight`` is skipped while the
others go on.
"""

from __future__ import annotations

from collections.abc import KeysView
from dataclasses import dataclass

from shared.messages import TenantLimits


@dataclass(slots=True)
class _TenantState:
    max_queued: int | None = None
    max_in_flight: int | None = None
    num_waiting: int = 0
    num_running: int = 0


class TenantLedger:
    """Quotas and counts of every tenant with a request waiting or running."""

    __slots__ = ("_tenants",)

    def __init__(self) -> None:
        self._tenants: dict[str, _TenantState] = {}

    def set_limits(self, tenant: str, limits: TenantLimits) -> None:
        """The tenant's latest quotas (each submit carries them)."""
        state = self._state(tenant)
        state.max_queued = limits.max_queued
        state.max_in_flight = limits.max_in_flight

    def active(self) -> KeysView[str]:
        """Every tenant with a request waiting or running (a view that follows the ledger)."""
        return self._tenants.keys()

    def num_waiting(self, tenant: str) -> int:
        """The tenant's requests on no worker."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.num_waiting

    def num_running(self, tenant: str) -> int:
        """The tenant's requests placed on a worker."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.num_running

    def can_queue(self, tenant: str) -> bool:
        """Whether one more request of ``tenant`` may wait."""
        state = self._tenants.get(tenant)
        return state is None or state.max_queued is None or state.num_waiting < state.max_queued

    def can_run(self, tenant: str) -> bool:
        """Whether one more request of ``tenant`` may be placed on a worker."""
        state = self._tenants.get(tenant)
        return (
            state is None or state.max_in_flight is None or state.num_running < state.max_in_flight
        )

    def max_queued(self, tenant: str) -> int | None:
        """The tenant's cap on waiting requests, if any."""
        state = self._tenants.get(tenant)
        return None if state is None else state.max_queued

    def queued(self, tenant: str) -> None:
        """A new request of ``tenant`` waits."""
        self._state(tenant).num_waiting += 1

    def placed(self, tenant: str) -> None:
        """A waiting request went onto a worker."""
        state = self._tenants[tenant]
        state.num_waiting -= 1
        state.num_running += 1

    def unplaced(self, tenant: str) -> None:
        """A running request waits again (preempted, or its worker was lost)."""
        state = self._tenants[tenant]
        state.num_running -= 1
        state.num_waiting += 1

    def left_waiting(self, tenant: str) -> None:
        """A waiting request ended (cancelled)."""
        self._tenants[tenant].num_waiting -= 1
        self._forget_if_idle(tenant)

    def left_running(self, tenant: str) -> None:
        """A running request ended (finished or cancelled)."""
        self._tenants[tenant].num_running -= 1
        self._forget_if_idle(tenant)

    def _state(self, tenant: str) -> _TenantState:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _TenantState()
        return state

    def _forget_if_idle(self, tenant: str) -> None:
        # Memory stays bounded by the active tenants; the quotas come back with
        # the tenant's next submit, which carries them.
        state = self._tenants[tenant]
        assert state.num_waiting >= 0 and state.num_running >= 0
        if state.num_waiting == 0 and state.num_running == 0:
            del self._tenants[tenant]
