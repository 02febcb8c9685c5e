"""What a scheduling policy is, and the one place that picks the policy class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.plan_builder import PlanBuilder
from scheduler_actor.request import Request
from scheduler_actor.tenant_ledger import TenantLedger
from scheduler_actor.vtc import VirtualTokenCounter
from scheduler_actor.worker_state import WorkerState

# Whether ``worker`` is where a waiting request should be placed now.
IsPreferred = Callable[[WorkerState, Request], bool]


class Policy(Protocol):
    """Owns the waiting requests and decides who runs in each step.

    Its waiting queue changes only through ``Placements.move`` (``enqueue``,
    ``dequeue``, ``discard``); ``fill`` picks who runs and places them through
    the builder."""

    @property
    def holds_results_until_batch_end(self) -> bool:
        """True when finished results wait for their whole batch (``request``)."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a worker."""
        ...

    def enqueue(self, request: Request) -> None:
        """Add a waiting request (new, preempted, or from a lost worker)."""
        ...

    def dequeue(self, request: Request) -> None:
        """Take out the waiting request ``fill`` just chose (it is being placed)."""
        ...

    def discard(self, request: Request) -> None:
        """Forget a waiting request that is being cancelled."""
        ...

    def fill(self, builder: PlanBuilder) -> None:
        """Choose this step's work for ``builder.worker``."""
        ...


def make_policy(
    config: SchedulerConfig,
    vtc: VirtualTokenCounter,
    tenants: TenantLedger,
    is_preferred: IsPreferred,
) -> Policy:
    """The policy object ``config.policy`` names."""
    # Imported here: each policy module imports this one for the protocol.
    from scheduler_actor.policy_fair import FairPolicy
    from scheduler_actor.policy_orca import OrcaPolicy
    from scheduler_actor.policy_request import RequestLevelPolicy

    if config.policy is PolicyName.REQUEST:
        return RequestLevelPolicy(config, tenants, is_preferred)
    if config.policy is PolicyName.ORCA:
        return OrcaPolicy(config, tenants, is_preferred)
    return FairPolicy(config, vtc, tenants, is_preferred)
