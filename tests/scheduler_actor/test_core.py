"""Unit tests of the scheduler core's events and each policy's shape."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_actor.block_ledger import BlockLedger, num_blocks_for
from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.errors import (
    ConfigError,
    DuplicateRequestError,
    InvalidRequestError,
    RequestTooLargeError,
    UnknownWorkerError,
)
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SampledToken, SamplingParams, StepOutput
from shared.settings import MAX_INFLIGHT


def _scheduler(policy=PolicyName.FAIR, num_blocks=16, block_size=4, max_inflight=1, **kwargs):
    scheduler = Scheduler(SchedulerConfig(policy=policy, **kwargs), lambda: 0.0)
    scheduler.worker_joined("w", num_blocks, block_size, max_inflight)
    worker = SimulatedWorker("w", num_blocks, block_size, CostModel())
    return scheduler, worker


def _submit(scheduler, request_id, num_prompt_tokens, max_tokens, tenant="t"):
    scheduler.submit(
        request_id, tenant, [5] * num_prompt_tokens, SamplingParams(max_tokens=max_tokens)
    )


def test_ledger_check_then_act() -> None:
    ledger = BlockLedger(num_blocks=3, block_size=4)
    assert num_blocks_for(9, 4) == 3 and ledger.blocks_for(8) == 2
    assert ledger.can_allocate(3) and not ledger.can_allocate(4)
    block_ids = ledger.allocate(2)
    assert ledger.num_free == 1 and len(set(block_ids)) == 2
    ledger.release(block_ids)
    assert ledger.num_free == 3


def test_submit_rejects_bad_requests() -> None:
    scheduler, _ = _scheduler()
    with pytest.raises(InvalidRequestError):
        scheduler.submit("x", "t", [], SamplingParams())
    _submit(scheduler, "a", 4, 4)
    with pytest.raises(DuplicateRequestError):
        _submit(scheduler, "a", 4, 4)
    with pytest.raises(RequestTooLargeError):
        _submit(scheduler, "big", 60, 5)  # 65 slots > 16 blocks * 4
    with pytest.raises(UnknownWorkerError):
        scheduler.next_plan("nobody")
    with pytest.raises(ConfigError):
        SchedulerConfig(max_batch_size=0)


def test_orca_reserves_up_front_and_never_skips_ahead() -> None:
    scheduler, _ = _scheduler(PolicyName.ORCA, num_blocks=10, block_size=4)
    _submit(scheduler, "a", 8, 16)  # 24 slots: 6 blocks
    _submit(scheduler, "b", 8, 16)  # would need 6 more: does not fit
    _submit(scheduler, "c", 1, 1)  # would fit, but must not skip ahead of b
    plan = scheduler.next_plan("w")
    assert plan is not None
    assert [spec.request_id for spec in plan.new_requests] == ["a"]
    assert scheduler.workers["w"].ledger.num_used == 6


def test_request_level_holds_results_until_batch_end() -> None:
    scheduler, worker = _scheduler(PolicyName.REQUEST, max_batch_size=2)
    _submit(scheduler, "short", 2, 1)
    _submit(scheduler, "long", 2, 3)
    plan = scheduler.next_plan("w")
    assert plan is not None and len(plan.new_requests) == 2
    assert scheduler.on_result(worker.execute(plan)[0]) == []  # "short" done but held
    _submit(scheduler, "late", 2, 1)
    released = []
    while not released:
        plan = scheduler.next_plan("w")
        assert plan is not None and not plan.new_requests  # nobody joins
        released = scheduler.on_result(worker.execute(plan)[0])
    assert sorted(item.request_id for item in released) == ["long", "short"]


def test_fair_chunks_prompts_within_budget_decodes_first() -> None:
    scheduler, worker = _scheduler(num_blocks=64, token_budget=8, max_chunk_tokens=8)
    _submit(scheduler, "a", 3, 4)
    plan = scheduler.next_plan("w")
    assert plan is not None
    scheduler.on_result(worker.execute(plan)[0])
    _submit(scheduler, "b", 20, 4)
    plan = scheduler.next_plan("w")
    assert plan is not None
    assert plan.decode_request_ids == ["a"]
    assert [len(chunk.token_ids) for chunk in plan.prefill_chunks] == [7]
    assert plan.num_new_tokens == 8


def test_overlap_plans_ahead_and_stop_costs_one_slot_at_most() -> None:
    scheduler, _worker = _scheduler(num_blocks=16, block_size=1, max_inflight=2)
    _submit(scheduler, "a", 2, 10)
    first = scheduler.next_plan("w")
    second = scheduler.next_plan("w")  # before the first result returns
    assert first is not None and second is not None
    assert second.decode_request_ids == ["a"]
    assert scheduler.next_plan("w") is None  # max_inflight reached
    assert scheduler.workers["w"].ledger.num_used == 3  # prompt + one speculative slot
    stop = StepOutput(
        worker_id="w",
        epoch=0,
        step_index=first.step_index,
        tokens=[SampledToken("a", 7, 0, "stop")],
    )
    released = scheduler.on_result(stop)
    assert [item.request_id for item in released] == ["a"]
    assert scheduler.workers["w"].ledger.num_used == 0


def test_cancel_releases_on_next_plan() -> None:
    scheduler, worker = _scheduler()
    _submit(scheduler, "a", 4, 8)
    _submit(scheduler, "b", 4, 8)
    plan = scheduler.next_plan("w")
    assert plan is not None
    scheduler.on_result(worker.execute(plan)[0])
    [cancelled] = scheduler.cancel("a")
    assert cancelled.finish_reason == "cancelled"
    assert scheduler.cancel("a") == []
    plan = scheduler.next_plan("w")
    assert plan is not None and plan.released_request_ids == ["a"]


def test_lost_worker_recomputes_from_generated_tokens() -> None:
    scheduler, worker = _scheduler()
    _submit(scheduler, "a", 3, 8)
    for _ in range(3):
        plan = scheduler.next_plan("w")
        assert plan is not None
        scheduler.on_result(worker.execute(plan)[0])
    assert scheduler.worker_lost("w") == []
    scheduler.worker_joined("w2", 16, 4, 1)
    plan = scheduler.next_plan("w2")
    assert plan is not None
    [spec] = plan.new_requests
    assert (spec.num_prompt_tokens, spec.num_generated) == (6, 3)
    assert plan.prefill_chunks[0].token_ids == [5, 5, 5, 1000, 1001, 1002]


def test_stale_result_is_ignored() -> None:
    scheduler, _ = _scheduler()
    stale = StepOutput(worker_id="w", epoch=0, step_index=99, tokens=[SampledToken("a", 1, 0)])
    assert scheduler.on_result(stale) == []
    assert scheduler.on_result(StepOutput(worker_id="gone", epoch=0, step_index=0)) == []


def test_fair_preempts_and_recomputes_when_blocks_run_out() -> None:
    scheduler, worker = _scheduler(num_blocks=4, block_size=4, max_batch_size=4)
    _submit(scheduler, "a", 4, 12, tenant="x")
    _submit(scheduler, "b", 4, 12, tenant="y")
    finished = {}
    for _ in range(200):
        plan = scheduler.next_plan("w")
        if plan is None:
            break
        for item in scheduler.on_result(worker.execute(plan)[0]):
            finished[item.request_id] = item
    assert sorted(finished) == ["a", "b"]
    assert sum(item.num_preemptions for item in finished.values()) >= 1
    assert all(item.token_ids == [1000 + i for i in range(12)] for item in finished.values())


def test_a_recovered_request_continues_after_the_tokens_already_sent() -> None:
    """A new scheduler submits a request with the tokens its log holds: the worker
    prefills prompt + those tokens and the next token has their count as index."""
    scheduler = Scheduler(SchedulerConfig(policy=PolicyName.FAIR, epoch=2), lambda: 0.0)
    scheduler.worker_joined("w", num_blocks=64, block_size=16)
    scheduler.submit("r", "t", [1, 2, 3], SamplingParams(max_tokens=6), generated_ids=[7, 8])
    plan = scheduler.next_plan("w")
    assert plan is not None
    [spec] = plan.new_requests
    assert spec.num_generated == 2 and spec.num_prompt_tokens == 5
    assert [chunk.token_ids for chunk in plan.prefill_chunks] == [[1, 2, 3, 7, 8]]


@pytest.mark.parametrize("max_inflight", [0, -1, MAX_INFLIGHT + 1, 10**9])
def test_a_join_with_a_lookahead_out_of_range_is_refused(max_inflight: int) -> None:
    scheduler = Scheduler(SchedulerConfig(), lambda: 0.0)
    with pytest.raises(InvalidRequestError, match="max_inflight"):
        scheduler.worker_joined("w", 16, 4, max_inflight)
    assert "w" not in scheduler.workers
    scheduler.worker_joined("w", 16, 4, MAX_INFLIGHT)


def _requests_of(plan) -> set[str]:
    return {*plan.decode_request_ids, *(chunk.request_id for chunk in plan.prefill_chunks)}


@pytest.mark.parametrize("policy", [PolicyName.FAIR, PolicyName.ORCA])
def test_a_pipeline_rotates_its_requests_through_one_plan_per_stage(policy) -> None:
    # Orca's Figure 8: a group of two stages keeps two plans in flight, each a batch
    # of its own; a request is never in two of them (its next input is the last
    # stage's sample), and the running requests split between the two.
    scheduler = Scheduler(SchedulerConfig(policy=policy), lambda: 0.0)
    scheduler.worker_joined("g", 64, 4, max_inflight=2, pipeline_depth=2)
    worker = SimulatedWorker("g", 64, 4, CostModel())
    for name in "abcd":
        _submit(scheduler, name, 3, 40)
    first = scheduler.next_plan("g")
    assert first is not None and _requests_of(first) == set("abcd")  # all admitted at once
    assert scheduler.next_plan("g") is None  # nobody is free for the second stage yet
    output, _ = worker.execute(first)
    scheduler.on_result(output)
    in_flight = {}
    for _ in range(20):
        while (plan := scheduler.next_plan("g")) is not None:
            names = _requests_of(plan)
            assert all(not names & others for _, others in in_flight.values())
            in_flight[plan.step_index] = (plan, names)
        assert len(in_flight) == 2  # one plan per stage
        assert sorted(len(names) for _, names in in_flight.values()) == [2, 2]
        oldest = min(in_flight)
        plan, _ = in_flight.pop(oldest)
        output, _ = worker.execute(plan)
        scheduler.on_result(output)
    # The group's requests are in one plan at a time; one engine's may be in each of
    # its plans (its lookahead: test_overlap_plans_ahead_and_stop_costs_one_slot_at_most).
    assert scheduler.workers["g"].max_plans_per_request == 1


def test_a_pipelines_plans_stay_small_so_its_stages_take_alike_time() -> None:
    # One long prompt among decodes would keep the stage behind waiting for as long
    # as its chunk takes beyond the others' plans: a group's plans hold at most
    # pipeline_token_budget new tokens, its prompts go in chunks of at most that;
    # one engine (a depth of 1) takes the prompt whole within token_budget.
    config = SchedulerConfig(token_budget=512, max_chunk_tokens=512, pipeline_token_budget=24)
    scheduler = Scheduler(config, lambda: 0.0)
    scheduler.worker_joined("g", 64, 16, max_inflight=3, pipeline_depth=2)
    scheduler.worker_joined("w", 64, 16, max_inflight=1)
    _submit(scheduler, "long", 100, 4)
    plan = scheduler.next_plan("g") or scheduler.next_plan("w")
    assert plan is not None
    chunks = [len(chunk.token_ids) for chunk in plan.prefill_chunks]
    assert chunks == ([24] if plan.worker_id == "g" else [100])
    # Prompts of their own (no cached prefix): decodes and chunks share each plan.
    group_only = Scheduler(dataclasses.replace(config, prefix_caching=False), lambda: 0.0)
    group_only.worker_joined("g", 64, 16, max_inflight=3, pipeline_depth=2)
    worker = SimulatedWorker("g", 64, 16, CostModel())
    for name in "abcdef":
        _submit(group_only, name, 40, 6)
    seen_chunks: list[int] = []
    finished = []
    while (plan := group_only.next_plan("g")) is not None:
        new_tokens = len(plan.decode_request_ids) + sum(
            len(chunk.token_ids) for chunk in plan.prefill_chunks
        )
        assert new_tokens <= 24
        seen_chunks += [len(chunk.token_ids) for chunk in plan.prefill_chunks]
        output, _ = worker.execute(plan)
        finished += group_only.on_result(output)
    assert max(seen_chunks) == 24 and sum(seen_chunks) == 6 * 40
    assert len(finished) == 6
    with pytest.raises(ConfigError, match="pipeline_token_budget must be >= 1, got 0"):
        SchedulerConfig(pipeline_token_budget=0)


def test_a_join_with_a_pipeline_depth_below_one_is_refused() -> None:
    scheduler = Scheduler(SchedulerConfig(), lambda: 0.0)
    with pytest.raises(InvalidRequestError, match="pipeline_depth must be >= 1"):
        scheduler.worker_joined("g", 64, 4, max_inflight=2, pipeline_depth=0)
