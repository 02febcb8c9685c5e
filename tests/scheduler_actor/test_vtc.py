"""VTC's charges: a request's prompt once, at its first placement; each token once."""

from __future__ import annotations

import pytest

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.request import FinishedRequest
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams

W_IN, W_OUT = 1.0, 2.0


def _scheduler(policy: PolicyName, num_blocks: int, block_size: int, **kwargs) -> Scheduler:
    config = SchedulerConfig(policy=policy, w_in=W_IN, w_out=W_OUT, **kwargs)
    scheduler = Scheduler(config, lambda: 0.0)
    scheduler.worker_joined("w", num_blocks, block_size)
    return scheduler


def _run(scheduler: Scheduler, worker: SimulatedWorker, worker_id: str = "w") -> list:
    finished: list[FinishedRequest] = []
    for _ in range(500):
        plan = scheduler.next_plan(worker_id)
        if plan is None:
            break
        finished += scheduler.on_result(worker.execute(plan)[0])
    return finished


def test_a_preempted_request_is_charged_its_prompt_once() -> None:
    scheduler = _scheduler(PolicyName.FAIR, num_blocks=4, block_size=4, max_batch_size=4)
    for request_id, tenant in (("a", "x"), ("b", "y")):
        scheduler.submit(request_id, tenant, [5] * 4, SamplingParams(max_tokens=12))
    finished = _run(scheduler, SimulatedWorker("w", 4, 4, CostModel()))
    assert sorted(item.request_id for item in finished) == ["a", "b"]
    assert sum(item.num_preemptions for item in finished) >= 1
    # Recomputing prompt + generated tokens is not service: the prompt once, each token once.
    assert scheduler.vtc.snapshot() == {"x": W_IN * 4 + W_OUT * 12, "y": W_IN * 4 + W_OUT * 12}


@pytest.mark.parametrize("policy", list(PolicyName))
def test_a_request_recomputed_after_a_lost_worker_is_charged_its_prompt_once(policy) -> None:
    scheduler = _scheduler(policy, num_blocks=16, block_size=4)
    scheduler.submit("a", "x", [5] * 3, SamplingParams(max_tokens=8))
    worker = SimulatedWorker("w", 16, 4, CostModel())
    for _ in range(3):
        plan = scheduler.next_plan("w")
        assert plan is not None
        scheduler.on_result(worker.execute(plan)[0])
    assert scheduler.vtc.service("x") == W_IN * 3 + W_OUT * 3
    scheduler.worker_lost("w")
    scheduler.worker_joined("w2", 16, 4)
    [done] = _run(scheduler, SimulatedWorker("w2", 16, 4, CostModel()), "w2")
    assert len(done.token_ids) == 8
    assert scheduler.vtc.service("x") == W_IN * 3 + W_OUT * 8


def test_a_recovered_request_is_charged_its_prompt_and_only_its_new_tokens() -> None:
    """A new scheduler's counters start at zero: a request it recovers with the
    tokens already sent is charged its prompt once, and the tokens it generates
    from then on (the recovered ones are recomputed, not served again)."""
    scheduler = _scheduler(PolicyName.FAIR, num_blocks=64, block_size=16)
    scheduler.submit("r", "t", [1, 2, 3], SamplingParams(max_tokens=6), generated_ids=[7, 8])
    [done] = _run(scheduler, SimulatedWorker("w", 64, 16, CostModel()))
    assert done.token_ids[:2] == [7, 8] and len(done.token_ids) == 6
    assert scheduler.vtc.service("t") == W_IN * 3 + W_OUT * 4


def test_the_prompt_is_charged_at_placement_so_the_next_admission_of_the_step_sees_it() -> None:
    scheduler = _scheduler(PolicyName.FAIR, num_blocks=64, block_size=16, token_budget=512)
    for request_id, tenant in (("a0", "a"), ("a1", "a"), ("b0", "b")):
        scheduler.submit(request_id, tenant, [5] * 4, SamplingParams(max_tokens=4))
    plan = scheduler.next_plan("w")
    assert plan is not None
    # a0 raised a's counter above b's, so b0 is admitted before a1.
    assert [spec.request_id for spec in plan.new_requests] == ["a0", "b0", "a1"]
    assert scheduler.vtc.snapshot() == {"a": W_IN * 8, "b": W_IN * 4}
