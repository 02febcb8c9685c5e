"""Tenant quotas and weights carried by each submit: max_queued, max_in_flight, weight."""

from __future__ import annotations

import random
from collections import deque

import pytest

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.errors import QueueFullError
from scheduler_actor.request import RequestStatus
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams, TenantLimits

NUM_BLOCKS = 40
BLOCK_SIZE = 8


def _scheduler(policy: PolicyName, **kwargs) -> tuple[Scheduler, SimulatedWorker]:
    scheduler = Scheduler(SchedulerConfig(policy=policy, **kwargs), lambda: 0.0)
    scheduler.worker_joined("w", NUM_BLOCKS, BLOCK_SIZE, 2)
    return scheduler, SimulatedWorker("w", NUM_BLOCKS, BLOCK_SIZE, CostModel())


def _assert_ledger_matches(scheduler: Scheduler) -> None:
    """The ledger's counts are exactly the requests' statuses, tenant by tenant."""
    tenants = {request.tenant for request in scheduler.requests.values()}
    for tenant in tenants | {"a", "b"}:
        mine = [r for r in scheduler.requests.values() if r.tenant == tenant]
        waiting = sum(r.status is RequestStatus.WAITING for r in mine)
        running = sum(r.status is RequestStatus.PLACED for r in mine)
        assert scheduler.tenants.num_waiting(tenant) == waiting, tenant
        assert scheduler.tenants.num_running(tenant) == running, tenant


def test_max_queued_refuses_the_next_request_of_that_tenant_only() -> None:
    scheduler, _ = _scheduler(PolicyName.FAIR)
    limits = TenantLimits(max_queued=2)
    for index in range(2):
        scheduler.submit(f"a{index}", "a", [1] * 4, SamplingParams(max_tokens=4), limits=limits)
    with pytest.raises(QueueFullError, match="max_queued is 2"):
        scheduler.submit("a2", "a", [1] * 4, SamplingParams(max_tokens=4), limits=limits)
    assert "a2" not in scheduler.requests
    # Other tenants are not affected.
    scheduler.submit("b0", "b", [1] * 4, SamplingParams(max_tokens=4), limits=TenantLimits())
    # A cancel makes room again; so does a placement (running is not waiting).
    scheduler.cancel("a0")
    scheduler.submit("a3", "a", [1] * 4, SamplingParams(max_tokens=4), limits=limits)
    assert scheduler.next_plan("w") is not None
    scheduler.submit("a4", "a", [1] * 4, SamplingParams(max_tokens=4), limits=limits)
    _assert_ledger_matches(scheduler)


@pytest.mark.parametrize("policy", list(PolicyName))
def test_max_in_flight_caps_placement_without_starving_others(policy: PolicyName) -> None:
    scheduler, worker = _scheduler(policy, max_batch_size=8, token_budget=256)
    capped = TenantLimits(max_in_flight=2)
    # Tenant a arrives first with plenty of work; b comes after.
    for index in range(12):
        scheduler.submit(f"a{index}", "a", [1] * 6, SamplingParams(max_tokens=6), limits=capped)
    for index in range(6):
        scheduler.submit(f"b{index}", "b", [1] * 6, SamplingParams(max_tokens=6))
    pending: deque = deque()
    b_done_while_a_waits = False
    for _ in range(400):
        plan = scheduler.next_plan("w")
        if plan is not None:
            pending.append(worker.execute(plan)[0])
        assert scheduler.tenants.num_running("a") <= 2
        _assert_ledger_matches(scheduler)
        if pending and (plan is None or len(pending) >= 2):
            scheduler.on_result(pending.popleft())
        b_live = [r for r in scheduler.requests.values() if r.tenant == "b"]
        if not b_live and scheduler.tenants.num_waiting("a") > 0:
            b_done_while_a_waits = True
        if not scheduler.requests:
            break
    assert not scheduler.requests, "every request finishes"
    assert b_done_while_a_waits, "b was not held behind a's capped queue"


def test_max_in_flight_counts_preempted_and_lost_requests_back_as_waiting() -> None:
    scheduler, _ = _scheduler(PolicyName.FAIR, max_batch_size=8)
    capped = TenantLimits(max_in_flight=3)
    for index in range(5):
        scheduler.submit(f"a{index}", "a", [1] * 6, SamplingParams(max_tokens=6), limits=capped)
    plan = scheduler.next_plan("w")
    assert plan is not None and len(plan.new_requests) == 3
    assert scheduler.tenants.num_running("a") == 3
    scheduler.worker_lost("w")
    _assert_ledger_matches(scheduler)
    assert scheduler.tenants.num_waiting("a") == 5
    scheduler.worker_joined("w2", NUM_BLOCKS, BLOCK_SIZE, 1)
    plan = scheduler.next_plan("w2")
    assert plan is not None and len(plan.new_requests) == 3
    _assert_ledger_matches(scheduler)


def _weighted_run(weights: dict[str, float], seed: int, num_steps: int) -> tuple[float, float]:
    """Both tenants backlogged; their weights come only from what each submit carries."""
    scheduler, worker = _scheduler(PolicyName.FAIR, max_batch_size=16, token_budget=64)
    rng = random.Random(seed)
    for index in range(400):
        for tenant in ("a", "b"):
            scheduler.submit(
                f"{tenant}{index}",
                tenant,
                [1] * rng.randint(1, 64),
                SamplingParams(max_tokens=rng.randint(1, 64)),
                limits=TenantLimits(weight=weights[tenant]),
            )
    pending: deque = deque()
    num_backlogged_steps = 0
    for _ in range(num_steps):
        plan = scheduler.next_plan("w")
        if plan is not None:
            pending.append(worker.execute(plan)[0])
        if pending and (plan is None or len(pending) >= 2):
            scheduler.on_result(pending.popleft())
        # The shares are only promised while both tenants are backlogged.
        if not (scheduler.tenants.num_waiting("a") and scheduler.tenants.num_waiting("b")):
            break
        num_backlogged_steps += 1
    assert num_backlogged_steps > 1000, "too short a backlog to measure shares"
    return scheduler.vtc.service("a"), scheduler.vtc.service("b")


def test_weight_from_submit_gives_service_one_to_two() -> None:
    service_a, service_b = _weighted_run({"a": 1.0, "b": 2.0}, seed=7, num_steps=4000)
    assert abs(service_b / service_a - 2.0) <= 0.2


def test_weight_from_submit_overrides_the_configured_weight() -> None:
    scheduler, _ = _scheduler(PolicyName.FAIR, tenant_weights={"a": 4.0})
    assert scheduler.vtc.weight("a") == 4.0
    scheduler.submit("a0", "a", [1], SamplingParams(max_tokens=1), limits=TenantLimits(weight=0.5))
    assert scheduler.vtc.weight("a") == 0.5
    # Without limits (the simulator, old callers) the last known weight stays.
    scheduler.submit("a1", "a", [1], SamplingParams(max_tokens=1))
    assert scheduler.vtc.weight("a") == 0.5 and scheduler.vtc.weight("b") == 1.0
