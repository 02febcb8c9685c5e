"""The scheduler's metrics: a real core driven by simulated workers, and the actor
against a real redis-server; every check reads the registry in the text format
Prometheus scrapes, parsed with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_actor.actor import SchedulerActor
from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.metrics import SchedulerMetrics
from scheduler_actor.request import FinishedRequest
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams, StepPlan
from shared.redis_streams import connect
from shared.settings import RedisSettings, SchedulerSettings
from tests.scheduler_actor.test_actor import KEYS, PlanReader, join, submit

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(metrics: SchedulerMetrics, model_name: str = "") -> Samples:
    """Sample name -> (sorted labels -> value), as a scrape would see them;
    every sample carries ``model_name`` (checked, then left out)."""
    samples: Samples = {}
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == model_name, sample
            samples.setdefault(sample.name, {})[tuple(sorted(labels.items()))] = sample.value
    return samples


def by(samples: Samples, name: str, label: str) -> dict[str, float]:
    """One metric's values by the value of its one label."""
    return {dict(labels)[label]: value for labels, value in samples.get(name, {}).items()}


def _core(max_batch_size: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(PolicyName.FAIR, max_batch_size=max_batch_size), lambda: 0.0)


def _submit(core: Scheduler, request_id: str, tenant: str, num_prompt: int, max_tokens: int):
    core.submit(request_id, tenant, [5] * num_prompt, SamplingParams(max_tokens=max_tokens))


def test_a_turn_shows_in_the_gauges_and_counters() -> None:
    core = _core()
    metrics = SchedulerMetrics()
    metrics.watch(core)
    core.worker_joined("w1", num_blocks=8, block_size=4, max_inflight=2)
    core.worker_joined("w2", num_blocks=12, block_size=4, max_inflight=2)
    _submit(core, "a", "alice", 8, 4)
    _submit(core, "b", "alice", 8, 4)
    _submit(core, "c", "bob", 8, 4)
    before = scrape(metrics)
    assert by(before, "orcapod_tenant_requests_waiting", "tenant") == {"alice": 2, "bob": 1}
    assert by(before, "orcapod_tenant_requests_running", "tenant") == {"alice": 0, "bob": 0}
    assert by(before, "orcapod_kv_blocks_used", "worker") == {"w1": 0, "w2": 0}
    assert by(before, "orcapod_kv_pool_blocks", "worker") == {"w1": 8, "w2": 12}
    assert before["orcapod_num_requests_waiting"][()] == 3
    assert before["orcapod_num_requests_running"][()] == 0

    # Each request goes where the most K/V is free: a and c on w2, b on w1.
    plans = [plan for worker in ("w2", "w1") if (plan := core.next_plan(worker))]
    metrics.plans_sent(plans, core)
    after = scrape(metrics)
    # Exactly what the core's own bookkeeping says.
    tenants = core.tenants
    for tenant in ("alice", "bob"):
        waiting = by(after, "orcapod_tenant_requests_waiting", "tenant")[tenant]
        running = by(after, "orcapod_tenant_requests_running", "tenant")[tenant]
        assert (waiting, running) == (tenants.num_waiting(tenant), tenants.num_running(tenant))
    assert by(after, "orcapod_tenant_requests_running", "tenant") == {"alice": 2, "bob": 1}
    assert after["orcapod_num_requests_waiting"][()] == 0
    assert after["orcapod_num_requests_running"][()] == 3
    used = by(after, "orcapod_kv_blocks_used", "worker")
    usage = by(after, "orcapod_kv_cache_usage_perc", "worker")
    for worker_id, worker in core.workers.items():
        assert used[worker_id] == worker.ledger.num_used > 0
        assert usage[worker_id] == worker.ledger.num_used / worker.ledger.num_blocks
    assert by(after, "orcapod_vtc_service", "tenant") == dict(core.vtc.counters)
    assert by(after, "orcapod_vtc_service", "tenant") == {"alice": 16, "bob": 8}  # prompts
    assert by(after, "orcapod_plans_total", "worker") == {"w1": 1, "w2": 1}
    assert after["orcapod_num_preemptions_total"][()] == 0


def test_preemptions_count_every_recompute_and_no_cancel() -> None:
    """Blocks for two of three requests, and cancels of running ones: the
    counter matches the core's own per-request count of preemptions."""
    core = _core(max_batch_size=4)
    metrics = SchedulerMetrics()
    metrics.watch(core)
    core.worker_joined("w", num_blocks=6, block_size=4, max_inflight=1)
    worker = SimulatedWorker("w", 6, 4, CostModel())
    for index in range(6):
        _submit(core, f"r{index}", f"t{index % 2}", 4, 12)
    finished: dict[str, FinishedRequest] = {}
    num_plans = 0
    for step in range(500):
        if step in (9, 23):
            placed = sorted(core.workers["w"].placed)
            for item in core.cancel(placed[0]):
                finished[item.request_id] = item
        plan = core.next_plan("w")
        if plan is None:
            break
        metrics.plans_sent([plan], core)
        num_plans += 1
        for item in core.on_result(worker.execute(plan)[0]):
            finished[item.request_id] = item
    assert len(finished) == 6 and not core.requests
    num_preemptions = sum(item.num_preemptions for item in finished.values())
    assert num_preemptions >= 2
    samples = scrape(metrics)
    assert samples["orcapod_num_preemptions_total"][()] == num_preemptions
    assert samples["orcapod_plans_total"][(("worker", "w"),)] == num_plans


def test_gone_tenants_and_workers_leave_the_scrape_and_the_totals_stay_at_zero() -> None:
    core = _core()
    metrics = SchedulerMetrics()
    metrics.watch(core)
    core.worker_joined("w1", num_blocks=16, block_size=4)
    core.worker_joined("w2", num_blocks=16, block_size=4)
    _submit(core, "a", "alice", 4, 4)
    _submit(core, "b", "bob", 4, 4)
    assert set(by(scrape(metrics), "orcapod_tenant_requests_waiting", "tenant")) == {"alice", "bob"}
    core.cancel("a")
    core.worker_lost("w2")
    samples = scrape(metrics)
    assert set(by(samples, "orcapod_tenant_requests_waiting", "tenant")) == {"bob"}
    assert set(by(samples, "orcapod_kv_pool_blocks", "worker")) == {"w1"}
    # A new incarnation's core: nothing of the old one is reported.
    metrics.watch(_core())
    samples = scrape(metrics)
    for name in (
        "orcapod_tenant_requests_waiting",
        "orcapod_kv_pool_blocks",
        "orcapod_vtc_service",
    ):
        assert name not in samples


def test_before_any_core_the_registry_scrapes_empty_gauges() -> None:
    samples = scrape(SchedulerMetrics("SmolLM2-135M-Instruct"), "SmolLM2-135M-Instruct")
    assert "orcapod_kv_blocks_used" not in samples
    assert samples["orcapod_num_preemptions_total"][()] == 0
    assert samples["orcapod_num_requests_running"][()] == 0


def test_each_ended_request_shows_its_phases_and_lengths() -> None:
    """A core on a clock the test moves: queued 2 s, prefill 0.5 s, three more
    tokens 0.25 s apart; a cancelled request never placed has lengths only;
    one that failed is not observed."""
    now = [0.0]
    core = Scheduler(SchedulerConfig(PolicyName.FAIR), lambda: now[0])
    metrics = SchedulerMetrics()
    metrics.watch(core)
    _submit(core, "served", "alice", 10, 4)
    _submit(core, "cancelled", "bob", 6, 4)
    metrics.requests_finished(core.cancel("cancelled"))
    now[0] = 2.0
    core.worker_joined("w", num_blocks=16, block_size=4, max_inflight=1)
    worker = SimulatedWorker("w", 16, 4, CostModel())
    finished: list[FinishedRequest] = []
    while core.requests:
        plan = core.next_plan("w")
        assert plan is not None
        now[0] += 0.5 if plan.new_requests else 0.25
        finished += core.on_result(worker.execute(plan)[0])
    metrics.requests_finished(finished)
    samples = scrape(metrics)

    def histogram(name: str) -> tuple[float, float]:
        return samples[f"{name}_count"][()], samples[f"{name}_sum"][()]

    assert histogram("orcapod_request_queue_time_seconds") == (1, 2.0)
    assert histogram("orcapod_request_prefill_time_seconds") == (1, 0.5)
    assert histogram("orcapod_request_decode_time_seconds") == (1, 0.75)
    assert histogram("orcapod_request_inference_time_seconds") == (1, 1.25)
    assert histogram("orcapod_request_time_per_output_token_seconds") == (1, 0.25)
    assert histogram("orcapod_request_prompt_tokens") == (2, 16)
    assert histogram("orcapod_request_generation_tokens") == (2, 4)
    buckets = by(samples, "orcapod_request_prompt_tokens_bucket", "le")
    assert (buckets["5.0"], buckets["10.0"], buckets["+Inf"]) == (0, 2, 2)


def test_a_request_that_failed_is_not_observed() -> None:
    """On one lost worker after another until it ends with an error."""
    core = _core()
    _submit(core, "r", "alice", 4, 4)
    ended: list[FinishedRequest] = []
    while not ended:
        core.worker_joined("w", num_blocks=16, block_size=4)
        assert core.next_plan("w") is not None
        ended = core.worker_lost("w")
    assert [request.finish_reason for request in ended] == ["error"]
    metrics = SchedulerMetrics()
    metrics.requests_finished(ended)
    samples = scrape(metrics)
    assert samples["orcapod_request_prompt_tokens_count"][()] == 0
    assert samples["orcapod_request_queue_time_seconds_count"][()] == 0


def test_the_actor_reports_each_turn(redis_server) -> None:
    """A real actor on a real redis-server: a joined worker and a submit show
    up once the plan they lead to is in the worker's stream."""

    async def main() -> Samples:
        settings = SchedulerSettings(redis=RedisSettings(url=redis_server.url, prefix=KEYS.prefix))
        settings = dataclasses.replace(settings, policy="fair")
        actor_redis, test_redis = connect(redis_server.url), connect(redis_server.url)
        actor = SchedulerActor(settings, actor_redis)
        stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(actor.run(stop))
                try:
                    await join(test_redis, "w1", num_blocks=64)
                    await submit(test_redis, "r1", num_prompt_tokens=20, max_tokens=3)
                    plan = await PlanReader(test_redis, "w1").next()
                    assert isinstance(plan, StepPlan) and plan.new_requests
                    # No worker answers: the plans sent are all in the stream,
                    # and the counter follows the transaction that sent them.
                    deadline = time.monotonic() + 5
                    while True:
                        samples = scrape(actor.metrics)
                        num_sent = await test_redis.xlen(KEYS.plans("w1"))
                        if by(samples, "orcapod_plans_total", "worker") == {"w1": num_sent}:
                            return samples
                        assert time.monotonic() < deadline, (samples, num_sent)
                        await asyncio.sleep(0.01)
                finally:
                    stop.set()
        finally:
            await actor_redis.aclose()
            await test_redis.aclose()

    samples = asyncio.run(main())
    assert by(samples, "orcapod_tenant_requests_running", "tenant") == {"tenant": 1}
    assert by(samples, "orcapod_kv_blocks_used", "worker") == {"w1": 2}  # 20 tokens, 16 a block
    assert by(samples, "orcapod_kv_pool_blocks", "worker") == {"w1": 64}
    assert by(samples, "orcapod_vtc_service", "tenant") == {"tenant": 20}
