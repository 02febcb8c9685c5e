"""The scheduler's live view: the recorder against a real core driven by a
simulated worker, and the actor's snapshot key on a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from scheduler_actor.actor import SchedulerActor
from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.live_view import LiveView
from scheduler_actor.sim_worker import SimulatedWorker
from shared.live_stats import (
    MAX_STEPS_PER_WORKER,
    MAX_TENANTS,
    TTL_MS,
    LiveSnapshot,
    StepRecord,
    TenantLive,
    WorkerLive,
    decode_snapshot,
    encode_snapshot,
)
from shared.messages import SamplingParams, StepOutput, StepPlan
from shared.redis_streams import connect, send_message
from shared.settings import RedisSettings, SchedulerSettings
from tests.scheduler_actor.test_actor import KEYS, PlanReader, join, submit


def _core(
    policy: PolicyName = PolicyName.FAIR, max_batch_size: int = 64, token_budget: int = 512
) -> Scheduler:
    config = SchedulerConfig(policy, max_batch_size=max_batch_size, token_budget=token_budget)
    return Scheduler(config, lambda: 0.0)


def _submit(core: Scheduler, request_id: str, tenant: str, num_prompt: int, max_tokens: int):
    core.submit(request_id, tenant, [5] * num_prompt, SamplingParams(max_tokens=max_tokens))


def _plan(core: Scheduler, view: LiveView, worker_id: str) -> StepPlan:
    plan = core.next_plan(worker_id)
    assert plan is not None
    view.record_plan(plan)
    return plan


def _answer(core: Scheduler, view: LiveView, worker: SimulatedWorker, plan: StepPlan) -> StepOutput:
    output = worker.execute(plan)[0]
    view.record_output(output, len(core.on_result(output)))
    return output


def test_each_plan_and_its_result_is_one_step_record() -> None:
    core, view = _core(), LiveView()
    core.worker_joined("w", num_blocks=64, block_size=4, max_inflight=1)
    worker = SimulatedWorker("w", 64, 4, CostModel())
    _submit(core, "a", "alice", 6, 3)
    _submit(core, "b", "bob", 10, 2)

    first = _plan(core, view, "w")  # both join, both prompts run
    assert view.snapshot(core, 0).workers[0].steps == [
        StepRecord(first.step_index, 2, 16, 0, 2, 0, None)
    ]
    first_output = _answer(core, view, worker, first)
    second = _plan(core, view, "w")  # both decode; b's second token is its last
    second_output = _answer(core, view, worker, second)
    assert "b" not in core.requests
    core.cancel("a")  # released with the next plan that runs something
    _submit(core, "c", "carol", 4, 2)
    third = _plan(core, view, "w")
    assert third.released_request_ids == ["a"]

    assert view.snapshot(core, 0).workers[0].steps == [
        StepRecord(first.step_index, 2, 16, 0, 2, 0, first_output.step_ms, "simulated"),
        StepRecord(second.step_index, 2, 0, 2, 0, 1, second_output.step_ms, "simulated"),
        StepRecord(third.step_index, 1, 4, 0, 1, 1, None),
    ]
    assert first_output.step_ms > 0 and second_output.step_ms > 0


def test_a_worker_groups_steps_carry_each_stages_time() -> None:
    core, view = _core(), LiveView()
    core.worker_joined("g", num_blocks=64, block_size=4, max_inflight=2, pipeline_depth=2)
    _submit(core, "a", "alice", 6, 3)
    plan = _plan(core, view, "g")
    output = StepOutput("g", 0, plan.step_index, step_ms=9.0, path="pipeline", stage_ms=[4.0, 5.0])
    view.record_output(output, len(core.on_result(output)))
    [worker] = view.snapshot(core, 0).workers
    assert worker.pipeline_depth == 2
    assert worker.steps == [StepRecord(plan.step_index, 1, 6, 0, 1, 0, 9.0, "pipeline", [4.0, 5.0])]


def test_the_snapshot_is_what_the_core_knows() -> None:
    core, view = _core(), LiveView()
    core.worker_joined("w1", num_blocks=8, block_size=4, max_inflight=2)
    core.worker_joined("w2", num_blocks=12, block_size=4, max_inflight=2)
    _submit(core, "a", "alice", 8, 4)
    _submit(core, "b", "alice", 8, 4)
    _submit(core, "c", "bob", 8, 4)
    _plan(core, view, "w2")
    _plan(core, view, "w1")
    _submit(core, "d", "bob", 8, 4)  # waits: no plan after it

    snapshot = view.snapshot(core, now_ms=1_700_000_000_123)
    assert (snapshot.time_ms, snapshot.policy, snapshot.num_waiting) == (
        1_700_000_000_123,
        "fair",
        1,
    )
    workers = {worker.worker_id: worker for worker in snapshot.workers}
    for worker_id, worker in core.workers.items():
        live = workers[worker_id]
        assert (live.blocks_used, live.blocks_total, live.blocks_cached) == (
            worker.ledger.num_used,
            worker.ledger.num_blocks,
            0,
        )
        assert live.num_running == len(worker.placed) and live.blocks_used > 0
    assert {worker_id: w.num_running for worker_id, w in workers.items()} == {"w1": 1, "w2": 2}
    # Prompt tokens charged at first scheduling; alice's two before bob's one.
    assert snapshot.tenants == [TenantLive("alice", 16.0, 0, 2), TenantLive("bob", 8.0, 1, 1)]
    assert decode_snapshot(encode_snapshot(snapshot)) == snapshot


def test_a_worker_keeps_only_its_latest_steps() -> None:
    core, view = _core(), LiveView()
    core.worker_joined("w", num_blocks=256, block_size=4, max_inflight=1)
    worker = SimulatedWorker("w", 256, 4, CostModel())
    _submit(core, "a", "alice", 4, 500)
    plans = []
    for _ in range(3 * MAX_STEPS_PER_WORKER):
        plans.append(plan := _plan(core, view, "w"))
        _answer(core, view, worker, plan)
    steps = view.snapshot(core, 0).workers[0].steps
    assert [step.step_index for step in steps] == [
        plan.step_index for plan in plans[-MAX_STEPS_PER_WORKER:]
    ]
    assert all(step.step_ms is not None for step in steps)
    # A result of a plan long out of the view changes nothing.
    view.record_output(StepOutput("w", 0, plans[0].step_index, step_ms=99.0), 1)
    assert view.snapshot(core, 0).workers[0].steps == steps


def test_tenants_are_the_most_served_few() -> None:
    core, view = _core(max_batch_size=40, token_budget=10_000), LiveView()
    core.worker_joined("w", num_blocks=4096, block_size=4, max_inflight=1)
    num_tenants = MAX_TENANTS + 16
    for number in range(num_tenants):
        _submit(core, f"r{number}", f"t{number:03d}", 1 + number % 7, 4)
    _submit(core, "gone", "t_gone", 50, 4)
    core.cancel("gone")
    _plan(core, view, "w")  # 40 of them run: their prompts are charged
    tenants = view.snapshot(core, 0).tenants
    assert len(tenants) == MAX_TENANTS
    active = {f"t{number:03d}" for number in range(num_tenants)}
    ranked = sorted(active, key=lambda tenant: (-core.vtc.counter(tenant), tenant))
    assert [tenant.tenant for tenant in tenants] == ranked[:MAX_TENANTS]
    assert [tenant.service for tenant in tenants] == [
        core.vtc.counter(tenant) for tenant in ranked[:MAX_TENANTS]
    ]
    services = [tenant.service for tenant in tenants]
    assert services == sorted(services, reverse=True) and services[0] > services[-1]
    for tenant in tenants:
        assert (tenant.num_waiting, tenant.num_running) == (
            core.tenants.num_waiting(tenant.tenant),
            core.tenants.num_running(tenant.tenant),
        )
    assert {tenant.num_running for tenant in tenants} == {0, 1}


def test_without_the_fair_policy_no_service_is_reported() -> None:
    core, view = _core(PolicyName.ORCA), LiveView()
    core.worker_joined("w", num_blocks=64, block_size=4)
    _submit(core, "a", "zed", 12, 4)
    _submit(core, "b", "amy", 4, 4)
    _plan(core, view, "w")
    snapshot = view.snapshot(core, 0)
    assert snapshot.policy == "orca"
    assert snapshot.tenants == [TenantLive("amy", 0.0, 0, 1), TenantLive("zed", 0.0, 0, 1)]


def test_a_departed_worker_is_forgotten() -> None:
    core, view = _core(), LiveView()
    core.worker_joined("w1", num_blocks=16, block_size=4)
    core.worker_joined("w2", num_blocks=16, block_size=4)
    _submit(core, "a", "alice", 4, 8)
    _submit(core, "b", "bob", 4, 8)
    _plan(core, view, "w1")
    _plan(core, view, "w2")
    assert all(worker.steps for worker in view.snapshot(core, 0).workers)
    core.worker_lost("w2")
    assert [worker.worker_id for worker in view.snapshot(core, 0).workers] == ["w1"]
    # Back under the same id: none of its earlier steps come back with it.
    core.worker_joined("w2", num_blocks=32, block_size=4)
    back = view.snapshot(core, 0).workers[1]
    assert back == WorkerLive("w2", 0, 0, 32, 0, [])


def test_the_actor_publishes_the_live_view(redis_server) -> None:
    """A real actor on a real redis-server: the key appears with its TTL and
    shows the submitted request, the plan and then the worker's step time; it
    goes when the scheduler stops."""

    async def read_until(redis, predicate, timeout_s: float = 5.0) -> LiveSnapshot:
        deadline = time.monotonic() + timeout_s
        while True:
            data = await redis.get(KEYS.live_stats)
            if data is not None and predicate(snapshot := decode_snapshot(data)):
                return snapshot
            assert time.monotonic() < deadline, "the live view never showed it"
            await asyncio.sleep(0.02)

    async def main() -> None:
        settings = SchedulerSettings(redis=RedisSettings(url=redis_server.url, prefix=KEYS.prefix))
        settings = dataclasses.replace(settings, policy="fair")
        actor_redis, test_redis = connect(redis_server.url), connect(redis_server.url)
        stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(SchedulerActor(settings, actor_redis).run(stop))
                try:
                    await join(test_redis, "w1", num_blocks=64)
                    await submit(test_redis, "r1", num_prompt_tokens=20, max_tokens=3)
                    plan = await PlanReader(test_redis, "w1").next()
                    shown = await read_until(
                        test_redis, lambda s: bool(s.workers and s.workers[0].steps)
                    )
                    assert 0 < await test_redis.pttl(KEYS.live_stats) <= TTL_MS
                    assert shown.policy == "fair" and shown.num_waiting == 0
                    assert abs(shown.time_ms - time.time() * 1000) < 5_000
                    (worker,) = shown.workers
                    assert (worker.worker_id, worker.blocks_total, worker.num_running) == (
                        "w1",
                        64,
                        1,
                    )
                    assert worker.blocks_used == 2  # 20 tokens, 16 a block
                    assert worker.steps[0] == StepRecord(plan.step_index, 1, 20, 0, 1, 0, None)
                    assert shown.tenants == [TenantLive("tenant", 20.0, 0, 1)]

                    output = SimulatedWorker("w1", 64, 16, CostModel()).execute(plan)[0]
                    await send_message(test_redis, KEYS.results, output)
                    answered = await read_until(
                        test_redis, lambda s: s.workers[0].steps[0].step_ms is not None
                    )
                    assert answered.workers[0].steps[0].step_ms == output.step_ms
                finally:
                    stop.set()
            assert not await test_redis.exists(KEYS.live_stats)
        finally:
            await actor_redis.aclose()
            await test_redis.aclose()

    asyncio.run(main())
