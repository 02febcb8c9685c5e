"""Both admission caps live in the core's submit: the global ``max_waiting`` and
each tenant's ``max_queued``; the simulator, driving the same core, meets them."""

from __future__ import annotations

import json

import pytest

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.errors import ConfigError, DuplicateRequestError, QueueFullError
from scheduler_actor.simulate import main as simulate_main
from scheduler_actor.simulation import ClusterSpec, TraceRequest, run_simulation
from shared.messages import SamplingParams, TenantLimits

SAMPLING = SamplingParams(max_tokens=4)


def _scheduler(max_waiting: int | None) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(max_waiting=max_waiting), lambda: 0.0)
    scheduler.worker_joined("w", num_blocks=64, block_size=4)
    return scheduler


def test_max_waiting_refuses_any_tenant_once_that_many_wait() -> None:
    scheduler = _scheduler(max_waiting=2)
    scheduler.submit("a0", "a", [1] * 4, SAMPLING)
    scheduler.submit("b0", "b", [1] * 4, SAMPLING)
    with pytest.raises(QueueFullError) as refused:
        scheduler.submit("c0", "c", [1] * 4, SAMPLING, limits=TenantLimits(max_queued=10))
    # What the client is told, as before the cap moved into the core.
    assert str(refused.value) == "the service is at capacity; retry later"
    assert "c0" not in scheduler.requests
    # A refused tenant with nothing live leaves nothing in the tenant ledger.
    assert set(scheduler.tenants.active()) == {"a", "b"}
    # Running is not waiting: once placed, the requests make room again.
    assert scheduler.next_plan("w") is not None and scheduler.num_waiting == 0
    scheduler.submit("c0", "c", [1] * 4, SAMPLING)


def test_max_waiting_does_not_refuse_a_recovered_request_or_hide_a_duplicate() -> None:
    scheduler = _scheduler(max_waiting=1)
    scheduler.submit("a0", "a", [1] * 4, SAMPLING)
    # Accepted once already, by an earlier scheduler: it keeps its place.
    scheduler.submit("old", "a", [1] * 4, SAMPLING, generated_ids=[7], is_recovered=True)
    assert scheduler.num_waiting == 2
    # A re-sent submit of a live request is a duplicate (dropped), not a refusal.
    with pytest.raises(DuplicateRequestError):
        scheduler.submit("a0", "a", [1] * 4, SAMPLING)
    with pytest.raises(QueueFullError):
        scheduler.submit("a1", "a", [1] * 4, SAMPLING)


def test_max_waiting_must_not_be_negative() -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(max_waiting=-1)


def _burst(tenant: str, num_requests: int, offset_s: float = 0.0) -> list[TraceRequest]:
    """Requests a microsecond apart: nothing finishes while they arrive."""
    return [
        TraceRequest(f"{tenant}-{index}", tenant, offset_s + index * 1e-6, 32, 8)
        for index in range(num_requests)
    ]


@pytest.mark.parametrize("policy", list(PolicyName))
def test_a_simulated_burst_beyond_max_waiting_is_refused(policy: PolicyName) -> None:
    trace = _burst("a", 40)
    config = SchedulerConfig(policy=policy, max_batch_size=4, max_waiting=10)
    result = run_simulation(config, trace, ClusterSpec(max_inflight=1))
    finished_ids = {record.request_id for record in result.finished}
    assert result.refused_ids, "the burst never met the cap"
    # Every request either ran to its end or was refused, never both.
    assert finished_ids.isdisjoint(result.refused_ids)
    assert finished_ids | set(result.refused_ids) == {item.request_id for item in trace}
    # At most max_waiting wait beside the one plan's batch while the burst arrives.
    assert len(finished_ids) <= 10 + 4
    # The same trace without the cap: nobody is refused.
    unbounded = SchedulerConfig(policy=policy, max_batch_size=4)
    assert run_simulation(unbounded, trace, ClusterSpec(max_inflight=1)).refused_ids == []


def test_a_simulated_tenant_over_its_max_queued_is_refused_and_the_other_is_not() -> None:
    trace = sorted(_burst("a", 20) + _burst("b", 20, offset_s=5e-7), key=lambda r: r.arrival_s)
    config = SchedulerConfig(max_batch_size=4)
    limits = {"a": TenantLimits(max_queued=3)}
    result = run_simulation(config, trace, ClusterSpec(max_inflight=1), tenant_limits=limits)
    assert result.refused_ids and all(rid.startswith("a-") for rid in result.refused_ids)
    assert len(result.finished) + len(result.refused_ids) == len(trace)


def test_simulate_reports_the_requests_max_waiting_refused(tmp_path) -> None:
    out = tmp_path / "out"
    argv = ["--policies", "fair", "--rates", "1000", "--num-requests", "60", "--skip-tenants"]
    assert simulate_main([*argv, "--max-waiting", "5", "--out", str(out)]) == 0
    [row] = json.loads((out / "results.json").read_text())["rows"]
    assert 0 < row["num_refused"] < 60
    assert simulate_main([*argv, "--max-waiting", "0", "--out", str(out)]) == 2
