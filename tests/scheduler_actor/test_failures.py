"""No poison pill in the core: a request a worker reports failed, or one that was
on two workers that failed, ends with "error" and is never placed again, and
the block ledger, the tenant ledger and the other requests stay consistent."""

from __future__ import annotations

import msgspec
import pytest

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import MAX_WORKERS_LOST, WORKERS_LOST_MESSAGE, Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.request import FinishedRequest
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import RequestFailure, SamplingParams, StepOutput, StepPlan

NUM_BLOCKS, BLOCK_SIZE = 32, 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _scheduler(policy: PolicyName, clock: Clock, worker_ids: tuple[str, ...] = ("w",)):
    scheduler = Scheduler(SchedulerConfig(policy=policy), clock)
    workers = {}
    for worker_id in worker_ids:
        scheduler.worker_joined(worker_id, NUM_BLOCKS, BLOCK_SIZE, max_inflight=1)
        workers[worker_id] = SimulatedWorker(worker_id, NUM_BLOCKS, BLOCK_SIZE, CostModel())
    return scheduler, workers


def _submit(scheduler: Scheduler, request_id: str, tenant: str = "t", max_tokens: int = 4) -> None:
    scheduler.submit(request_id, tenant, [5] * 6, SamplingParams(max_tokens=max_tokens))


def _run(worker: SimulatedWorker, plan: StepPlan) -> StepOutput:
    output, _ = worker.execute(plan)
    return output


def _failing(output: StepOutput, request_id: str, message: str = "boom") -> StepOutput:
    """``output`` as the worker reports it when ``request_id`` failed in the step."""
    tokens = [t for t in output.tokens if t.request_id != request_id]
    return msgspec.structs.replace(
        output, tokens=tokens, failed=[RequestFailure(request_id, message)]
    )


def _drain(scheduler: Scheduler, worker: SimulatedWorker) -> list[FinishedRequest]:
    finished: list[FinishedRequest] = []
    for _ in range(100):
        plan = scheduler.next_plan(worker.worker_id)
        if plan is None:
            break
        finished += scheduler.on_result(_run(worker, plan))
    return finished


@pytest.mark.parametrize("policy", list(PolicyName))
def test_a_request_that_failed_on_its_worker_ends_with_error_and_never_runs_again(policy):
    clock = Clock()
    scheduler, workers = _scheduler(policy, clock)
    worker = workers["w"]
    _submit(scheduler, "poison", tenant="a")
    _submit(scheduler, "fine", tenant="b")
    plan = scheduler.next_plan("w")
    assert plan is not None and {s.request_id for s in plan.new_requests} == {"poison", "fine"}
    clock.now_s = 2.0
    released = scheduler.on_result(_failing(_run(worker, plan), "poison", "bad numbers"))
    worker.execute(StepPlan("w", 0, -1, released_request_ids=["poison"]))  # what the worker did
    ended = [r for r in released if r.request_id == "poison"]
    assert [(r.finish_reason, r.error, r.finish_s) for r in ended] == [
        ("error", "bad numbers", 2.0)
    ]
    assert "poison" not in scheduler.requests
    assert scheduler.tenants.num_running("a") == 0 and scheduler.tenants.num_waiting("a") == 0
    finished = released + _drain(scheduler, worker)
    assert sorted((r.request_id, r.finish_reason) for r in finished) == [
        ("fine", "length"),
        ("poison", "error"),
    ]
    assert scheduler.workers["w"].ledger.num_used == 0
    assert scheduler.requests == {}


def test_a_failure_reported_by_a_worker_that_no_longer_holds_the_request_is_ignored():
    scheduler, _ = _scheduler(PolicyName.FAIR, Clock(), ("w1", "w2"))
    _submit(scheduler, "r")
    plan = scheduler.next_plan("w1") or scheduler.next_plan("w2")
    assert plan is not None
    other = "w2" if plan.worker_id == "w1" else "w1"
    stale = StepOutput(other, 0, plan.step_index, failed=[RequestFailure("r", "not mine")])
    assert scheduler.on_result(stale) == []
    assert "r" in scheduler.requests


def test_a_request_on_two_failed_workers_ends_with_an_error_instead_of_a_third():
    clock = Clock()
    scheduler, workers = _scheduler(PolicyName.FAIR, clock, ("w1",))
    _submit(scheduler, "killer", tenant="a")
    plan = scheduler.next_plan("w1")
    assert plan is not None
    scheduler.on_result(_run(workers["w1"], plan))  # one token out: it is recomputed after
    assert scheduler.worker_lost("w1") == []
    assert scheduler.requests["killer"].num_workers_lost == 1
    assert scheduler.tenants.num_waiting("a") == 1
    scheduler.worker_joined("w1", NUM_BLOCKS, BLOCK_SIZE)  # the same id, restarted
    plan = scheduler.next_plan("w1")
    assert plan is not None and [s.request_id for s in plan.new_requests] == ["killer"]
    clock.now_s = 5.0
    [ended] = scheduler.worker_lost("w1")
    assert MAX_WORKERS_LOST == 2
    assert (ended.request_id, ended.finish_reason, ended.error) == (
        "killer",
        "error",
        WORKERS_LOST_MESSAGE,
    )
    assert len(ended.token_ids) == 1 and ended.finish_s == 5.0
    assert scheduler.requests == {} and scheduler.num_waiting == 0
    assert scheduler.tenants.num_waiting("a") == 0 and scheduler.tenants.num_running("a") == 0
    scheduler.worker_joined("w2", NUM_BLOCKS, BLOCK_SIZE)
    assert scheduler.next_plan("w2") is None


def test_a_clean_leave_does_not_count_as_a_failed_worker():
    scheduler, _ = _scheduler(PolicyName.FAIR, Clock())
    _submit(scheduler, "r")
    for _ in range(3):
        plan = scheduler.next_plan("w")
        assert plan is not None and [s.request_id for s in plan.new_requests] == ["r"]
        assert scheduler.worker_lost("w", failed=False) == []
        scheduler.worker_joined("w", NUM_BLOCKS, BLOCK_SIZE)
    assert scheduler.requests["r"].num_workers_lost == 0


def test_a_failure_under_request_level_batching_releases_the_held_batch():
    scheduler, workers = _scheduler(PolicyName.REQUEST, Clock())
    worker = workers["w"]
    scheduler.submit("short", "t", [5] * 2, SamplingParams(max_tokens=1))
    scheduler.submit("poison", "t", [5] * 2, SamplingParams(max_tokens=5))
    plan = scheduler.next_plan("w")
    assert plan is not None and len(plan.new_requests) == 2
    released = scheduler.on_result(_failing(_run(worker, plan), "poison"))
    assert sorted((r.request_id, r.finish_reason) for r in released) == [
        ("poison", "error"),
        ("short", "length"),
    ]
    assert scheduler.workers["w"].ledger.num_used == 0
