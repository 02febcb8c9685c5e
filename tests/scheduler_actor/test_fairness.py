"""VTC fairness under ``fair`` (and its absence under ``orca``)."""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams

NUM_BLOCKS = 40
BLOCK_SIZE = 8
MAX_PROMPT_TOKENS = 64


def _backlogged_run(config: SchedulerConfig, seed: int, num_steps: int):
    """Both tenants keep many requests waiting; yields the two counters (service
    divided by weight) after every result while both are backlogged."""
    scheduler = Scheduler(config, lambda: 0.0)
    scheduler.worker_joined("w", NUM_BLOCKS, BLOCK_SIZE, 2)
    worker = SimulatedWorker("w", NUM_BLOCKS, BLOCK_SIZE, CostModel())
    rng = random.Random(seed)
    for index in range(400):
        for tenant in ("a", "b"):
            scheduler.submit(
                f"{tenant}{index}",
                tenant,
                # Distinct prompts: a cached prefix would end the backlog early.
                [rng.randrange(50_000) for _ in range(rng.randint(1, MAX_PROMPT_TOKENS))],
                SamplingParams(max_tokens=rng.randint(1, 64)),
            )
    pending = deque()
    for _ in range(num_steps):
        plan = scheduler.next_plan("w")
        if plan is not None:
            pending.append(worker.execute(plan)[0])
        if pending and (plan is None or len(pending) >= 2):
            scheduler.on_result(pending.popleft())
            yield scheduler.vtc.counter("a"), scheduler.vtc.counter("b")


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 10_000),
    w_in=st.sampled_from([0.0, 1.0, 2.0]),
    w_out=st.sampled_from([1.0, 2.0]),
    max_batch_size=st.integers(1, 16),
)
def test_equal_weights_bounded_difference(seed, w_in, w_out, max_batch_size) -> None:
    config = SchedulerConfig(max_batch_size=max_batch_size, token_budget=64, w_in=w_in, w_out=w_out)
    kv_capacity_tokens = NUM_BLOCKS * BLOCK_SIZE
    bound = 2 * max(w_in * MAX_PROMPT_TOKENS, w_out * kv_capacity_tokens)
    for counter_a, counter_b in _backlogged_run(config, seed, 1500):
        assert abs(counter_a - counter_b) <= bound


def test_weights_one_to_two_give_service_one_to_two() -> None:
    config = SchedulerConfig(max_batch_size=16, token_budget=64, tenant_weights={"b": 2.0})
    scheduler_service = None
    for counter_a, counter_b in _backlogged_run(config, 7, 4000):
        scheduler_service = (counter_a * 1.0, counter_b * 2.0)
    assert scheduler_service is not None
    service_a, service_b = scheduler_service
    assert abs(service_b / service_a - 2.0) <= 0.2


def test_orca_serves_in_arrival_order_not_fairly() -> None:
    """Under orca a tenant that sends more gets more: FCFS, no fairness."""
    scheduler = Scheduler(SchedulerConfig(policy=PolicyName.ORCA, max_batch_size=4), lambda: 0.0)
    scheduler.worker_joined("w", NUM_BLOCKS, BLOCK_SIZE, 1)
    worker = SimulatedWorker("w", NUM_BLOCKS, BLOCK_SIZE, CostModel())
    for index in range(60):
        scheduler.submit(f"a{index}", "a", [1] * 8, SamplingParams(max_tokens=8))
    for index in range(20):
        scheduler.submit(f"b{index}", "b", [1] * 8, SamplingParams(max_tokens=8))
    for _ in range(100):
        plan = scheduler.next_plan("w")
        assert plan is not None
        scheduler.on_result(worker.execute(plan)[0])
    assert scheduler.vtc.service("b") == 0.0
