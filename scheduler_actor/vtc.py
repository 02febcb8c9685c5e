"""Weighted virtual token counters (VTC, Sheng et al., OSDI'24).

Each tenant's counter grows by ``w_in`` per prompt token and ``w_out`` per
generated token, divided by the tenant's weight. ``service`` keeps the same
charge undivided: what the tenant actually received, for reports and tests.
A tenant's weight is the one its latest submit carried (``set_weight``), else
the configured one, else 1.
"""

from __future__ import annotations

from collections.abc import Mapping

from scheduler_actor.config import SchedulerConfig


class VirtualTokenCounter:
    """Per-tenant virtual counters and accumulated service."""

    __slots__ = ("_config", "_weights", "counters", "services")

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._weights: dict[str, float] = {}
        self.counters: dict[str, float] = {}
        self.services: dict[str, float] = {}

    def set_weight(self, tenant: str, weight: float) -> None:
        """The tenant's weight from now on (charges already made stay as they were)."""
        assert weight > 0, "weights are validated where they are decoded"
        self._weights[tenant] = weight

    def weight(self, tenant: str) -> float:
        """The tenant's current weight."""
        weight = self._weights.get(tenant)
        return self._config.tenant_weight(tenant) if weight is None else weight

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter (0 before any service)."""
        return self.counters.get(tenant, 0.0)

    def service(self, tenant: str) -> float:
        """Weighted tokens the tenant received so far (not divided by weight)."""
        return self.services.get(tenant, 0.0)

    def charge(self, tenant: str, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        """Account tokens served to ``tenant``."""
        amount = self._config.w_in * num_prompt_tokens + self._config.w_out * num_generated_tokens
        self.services[tenant] = self.services.get(tenant, 0.0) + amount
        self.counters[tenant] = self.counter(tenant) + amount / self.weight(tenant)

    def lift(self, tenant: str, floor: float) -> None:
        """Raise the tenant's counter to ``floor`` when it becomes backlogged
        again, so idle time is not banked as credit."""
        if self.counter(tenant) < floor:
            self.counters[tenant] = floor

    def snapshot(self) -> Mapping[str, float]:
        """A copy of every tenant's service."""
        return dict(self.services)
