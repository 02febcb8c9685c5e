"""The scheduler's frozen configuration, built once at start and passed down."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler_actor.errors import ConfigError


class PolicyName(enum.Enum):
    """Which scheduling policy the core runs (see docs/scheduler.md)."""

    REQUEST = "request"
    ORCA = "orca"
    FAIR = "fair"


@dataclass(frozen=True)
class SchedulerConfig:
    """Policy and limits of one scheduler.

    ``token_budget`` and ``max_chunk_tokens`` bound the new tokens of one step
    under ``fair``, and ``pipeline_token_budget`` both on a worker group of
    several pipeline stages (``plan_builder.step_token_limits``); ``request``
    and ``orca`` run whole prompts, as the paper does. ``w_in`` / ``w_out``
    are VTC's prices of a prompt and a generated token; ``tenant_weights``
    divides them (missing tenants weigh 1) until a submit carries the
    tenant's own weight, which then wins.
    ``overlap`` lets a plan include requests of the outstanding plans before
    it that are certainly still running (up to the worker's
    ``max_inflight``). ``max_waiting`` caps the requests waiting for a
    worker, all tenants together (a submit beyond it is refused with
    QueueFullError; None: no cap); the service's is ``--max-waiting``
    (10,000). ``prefix_caching`` keeps the K/V of full prompt blocks after
    their requests leave and starts a prefill after its longest cached
    prefix (``prefix_cache.py``); with ``cache_aware_routing`` and several
    workers a request goes to the one caching its longest prefix unless that
    one runs more than ``routing_slack`` requests beyond the least loaded
    (``Scheduler._is_preferred``).
    """

    policy: PolicyName = PolicyName.FAIR
    max_batch_size: int = 64
    token_budget: int = 512
    max_chunk_tokens: int = 512
    pipeline_token_budget: int = 64
    w_in: float = 1.0
    w_out: float = 2.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    overlap: bool = True
    max_waiting: int | None = None
    epoch: int = 0
    prefix_caching: bool = True
    cache_aware_routing: bool = True
    routing_slack: int = 8

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.token_budget < 1:
            raise ConfigError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.max_chunk_tokens < 1:
            raise ConfigError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")
        if self.pipeline_token_budget < 1:
            raise ConfigError(
                f"pipeline_token_budget must be >= 1, got {self.pipeline_token_budget}"
            )
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.routing_slack < 0:
            raise ConfigError(f"routing_slack must be >= 0, got {self.routing_slack}")
        if self.w_in < 0 or self.w_out < 0 or self.w_in + self.w_out == 0:
            raise ConfigError("w_in and w_out must be >= 0 and not both 0")
        for tenant, weight in self.tenant_weights.items():
            if weight <= 0:
                raise ConfigError(f"weight of tenant {tenant!r} must be > 0, got {weight}")

    def tenant_weight(self, tenant: str) -> float:
        """The VTC weight of ``tenant`` (1 unless configured)."""
        return self.tenant_weights.get(tenant, 1.0)
