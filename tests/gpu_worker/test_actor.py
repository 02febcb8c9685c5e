"""The worker actor with a tiny random model against a real redis-server; the
test plays the scheduler (plans in, results out) and the gateways (tokens)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from gpu_worker.__main__ import parse_settings
from gpu_worker.actor import WorkerActor
from gpu_worker.engine import Engine
from gpu_worker.engine_host import EngineThread
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.llama import LlamaModel
from gpu_worker.model_loading import load_model
from shared.keys import MESSAGE_FIELD, WORKER_GROUP, RedisKeys
from shared.messages import (
    PrefillChunk,
    RequestSpec,
    SamplingParams,
    StepOutput,
    StepPlan,
    TokenBatch,
    WorkerJoined,
    WorkerLeft,
    decode_control_message,
    decode_gateway_message,
    decode_worker_message,
)
from shared.redis_streams import connect, send_message
from shared.settings import MAX_INFLIGHT, ModelLocation, RedisSettings, WorkerSettings
from tests.gpu_worker.plans import Job, grants_up_front, run_jobs
from tests.gpu_worker.tiny_models import write_tiny_model

KEYS = RedisKeys("test")
WORKER = "w1"
GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)
PROMPTS = {"r0": [5, 9, 11, 40], "r1": [7, 3, 22]}

Scenario = Callable[[aioredis.Redis, "Scheduler"], Awaitable[None]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(model_dir, device="cpu", dtype="float32")


def make_engine(model: LlamaModel, num_blocks: int = 32, block_size: int = 4) -> Engine:
    num_bytes = num_blocks * bytes_per_block(model.config, block_size, model.dtype)
    budget = KVCacheBudget(num_bytes=num_bytes, block_size=block_size)
    return Engine(model, budget, "cpu", worker_id=WORKER)


class Scheduler:
    """The test's side: plans in, results and token batches out."""

    def __init__(self, redis: aioredis.Redis, pubsub: aioredis.client.PubSub) -> None:
        self.redis = redis
        self.pubsub = pubsub
        self.results_id = "0-0"

    async def joined(self) -> WorkerJoined:
        """The worker's registration on the control stream."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for _, fields in await self.redis.xrange(KEYS.control):
                message = decode_control_message(fields[MESSAGE_FIELD.encode()])
                if isinstance(message, WorkerJoined):
                    return message
            await asyncio.sleep(0.02)
        raise AssertionError("the worker never joined")

    async def send(self, plan: StepPlan) -> None:
        """XADD a plan to the worker's stream."""
        await send_message(self.redis, KEYS.plans(WORKER), plan)

    async def result(self, timeout_s: float = 5.0) -> StepOutput:
        """The next StepOutput on the results stream."""
        reply = await self.redis.xread(
            {KEYS.results: self.results_id}, count=1, block=int(timeout_s * 1000)
        )
        assert reply, "no result in time"
        entry_id, fields = reply[0][1][0]
        self.results_id = entry_id.decode()
        output = decode_worker_message(fields[MESSAGE_FIELD.encode()])
        assert isinstance(output, StepOutput)
        return output

    async def batches(self, count: int) -> list[tuple[str, TokenBatch]]:
        """The next ``count`` token batches, with the channel each came on."""
        found: list[tuple[str, TokenBatch]] = []
        deadline = time.monotonic() + 5
        while len(found) < count and time.monotonic() < deadline:
            message = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if message is not None:
                batch = decode_gateway_message(message["data"])
                assert isinstance(batch, TokenBatch)
                found.append((message["channel"].decode(), batch))
        return found


def run_worker(url: str, model: LlamaModel, scenario: Scenario, heartbeat_s: float = 1.0) -> None:
    """Run the worker actor and ``scenario`` side by side; stop the worker when it ends."""

    async def main() -> None:
        settings = WorkerSettings(
            redis=RedisSettings(url=url, prefix=KEYS.prefix),
            model=ModelLocation(cache_dir=Path("."), model_dir=Path(".")),
            worker_id=WORKER,
            heartbeat_s=heartbeat_s,
        )
        worker_redis, test_redis = connect(url), connect(url)
        pubsub = test_redis.pubsub()
        await pubsub.subscribe(KEYS.tokens("gw1"), KEYS.tokens("gw2"))
        stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(
                    WorkerActor(
                        settings, worker_redis, EngineThread(make_engine(model), WORKER)
                    ).run(stop)
                )
                try:
                    await asyncio.wait_for(scenario(test_redis, Scheduler(test_redis, pubsub)), 20)
                finally:
                    stop.set()
        finally:
            await pubsub.aclose()
            await worker_redis.aclose()
            await test_redis.aclose()

    asyncio.run(main())


def admit(step_index: int, epoch: int = 1) -> StepPlan:
    """Admit r0 (gateway gw1) and r1 (gateway gw2) with their whole prompts."""
    specs = [
        RequestSpec("r0", len(PROMPTS["r0"]), GREEDY, gateway_id="gw1"),
        RequestSpec("r1", len(PROMPTS["r1"]), GREEDY, gateway_id="gw2"),
    ]
    return StepPlan(
        worker_id=WORKER,
        epoch=epoch,
        step_index=step_index,
        new_requests=specs,
        prefill_chunks=[PrefillChunk(rid, ids, 0) for rid, ids in PROMPTS.items()],
        block_grants=grants_up_front(specs),
    )


def decode(step_index: int, request_ids: list[str], epoch: int = 1) -> StepPlan:
    """One decode step of ``request_ids``."""
    return StepPlan(WORKER, epoch, step_index, decode_request_ids=request_ids)


def expected_tokens(model: LlamaModel) -> dict[str, list[int]]:
    """The same requests run on an engine directly."""
    jobs = [Job(rid, ids, GREEDY) for rid, ids in PROMPTS.items()]
    run_jobs(make_engine(model), jobs)
    return {job.request_id: job.generated_ids for job in jobs}


def test_registers_runs_plans_and_publishes_per_gateway(redis_server, model):
    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        joined = await scheduler.joined()
        engine = make_engine(model)
        assert (joined.num_blocks, joined.block_size) == (engine.num_blocks, engine.block_size)
        assert joined.max_inflight == 3
        assert await redis.exists(KEYS.worker_heartbeat(WORKER))
        # Two plans at once, as the scheduler sends them with overlap.
        await scheduler.send(admit(1))
        await scheduler.send(decode(2, ["r0", "r1"]))
        await scheduler.send(decode(3, ["r0", "r1"]))
        outputs = [await scheduler.result() for _ in range(3)]
        assert [output.step_index for output in outputs] == [1, 2, 3]
        generated: dict[str, list[int]] = {}
        for channel, batch in await scheduler.batches(6):
            assert batch.worker_id == WORKER
            for token in batch.tokens:
                assert channel == KEYS.tokens("gw1" if token.request_id == "r0" else "gw2")
                assert token.index == len(generated.setdefault(token.request_id, []))
                generated[token.request_id].append(token.token_id)
        assert generated == expected_tokens(model)
        assert outputs[-1].finished_request_ids == ["r0", "r1"]
        stats = await redis.hgetall(KEYS.stats)
        assert int(stats[f"{WORKER}:num_steps".encode()]) == 3
        assert int(stats[f"{WORKER}:num_tokens".encode()]) == 7 + 2 + 2
        assert float(stats[f"{WORKER}:busy_s".encode()]) > 0
        pending = await redis.xpending(KEYS.plans(WORKER), WORKER_GROUP)
        assert pending["pending"] == 0

    run_worker(redis_server.url, model, scenario)
    client = redis.Redis.from_url(redis_server.url)
    left = [
        decode_control_message(f[MESSAGE_FIELD.encode()]) for _, f in client.xrange(KEYS.control)
    ]
    assert left[-1] == WorkerLeft(WORKER)
    assert not client.exists(KEYS.worker_heartbeat(WORKER))


def test_plans_of_an_old_epoch_are_skipped_and_a_new_epoch_drops_old_state(redis_server, model):
    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        await scheduler.send(admit(1, epoch=5))
        await scheduler.send(decode(2, ["r0"], epoch=4))  # an older scheduler's plan
        await scheduler.send(decode(3, ["r0"], epoch=5))
        first, second = await scheduler.result(), await scheduler.result()
        assert [(o.step_index, o.epoch) for o in (first, second)] == [(1, 5), (3, 5)]
        assert [(t.request_id, t.index) for t in second.tokens] == [("r0", 1)]
        # A newer scheduler knows nothing of r0: its decode is a bad plan.
        await scheduler.send(decode(4, ["r0"], epoch=6))
        assert (await scheduler.result()).tokens == []
        # Both the stale plan and the bad one are dead letters, with why.
        dead = await redis.xrange(KEYS.dead)
        assert [b"epoch 4" in fields[b"error"] for _, fields in dead] == [True, False]

    run_worker(redis_server.url, model, scenario)


def test_a_plan_out_of_order_is_refused_whole_and_the_next_one_runs(redis_server, model):
    """A step index at or below the last one run (a replayed or reordered plan)
    changes nothing: an empty output, a dead letter; the request goes on."""

    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        await scheduler.send(admit(5))
        await scheduler.send(decode(5, ["r0"]))  # the same step again
        await scheduler.send(decode(3, ["r0"]))  # an older one
        await scheduler.send(decode(6, ["r0"]))
        outputs = [await scheduler.result() for _ in range(4)]
        assert [(o.step_index, len(o.tokens)) for o in outputs] == [(5, 2), (5, 0), (3, 0), (6, 1)]
        dead = await redis.xrange(KEYS.dead)
        assert len(dead) == 2 and all(b"must come in the order" in f[b"error"] for _, f in dead)

    run_worker(redis_server.url, model, scenario)


def test_requests_admitted_again_while_still_here_stream_to_their_gateways(redis_server, model):
    """The scheduler took a second join of this worker id for a rejoin and admits
    its requests again while the engine still holds them: the stale state is
    dropped, and the new run's tokens still reach each request's gateway."""

    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        await scheduler.send(admit(1))
        await scheduler.send(decode(2, ["r0", "r1"]))
        await scheduler.send(admit(3))  # both again, from their prompts
        await scheduler.send(decode(4, ["r0", "r1"]))
        await scheduler.send(decode(5, ["r0", "r1"]))
        outputs = [await scheduler.result() for _ in range(5)]
        assert [len(output.tokens) for output in outputs] == [2] * 5
        assert outputs[-1].finished_request_ids == ["r0", "r1"]
        batches = await scheduler.batches(10)
        assert len(batches) == 10
        for channel, batch in batches:
            for token in batch.tokens:
                assert channel == KEYS.tokens("gw1" if token.request_id == "r0" else "gw2")
        rerun: dict[str, list[int]] = {}
        for _, batch in batches[4:]:
            for token in batch.tokens:
                rerun.setdefault(token.request_id, []).append(token.token_id)
        assert rerun == expected_tokens(model)

    run_worker(redis_server.url, model, scenario)


def test_a_bad_plan_goes_to_dead_with_an_empty_output_and_the_next_plan_runs(redis_server, model):
    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        await redis.xadd(KEYS.plans(WORKER), {MESSAGE_FIELD: b"\xc1 garbage"})
        await scheduler.send(decode(1, ["nobody"]))
        await scheduler.send(admit(2))
        refused, good = await scheduler.result(), await scheduler.result()
        assert (refused.step_index, refused.tokens, refused.num_new_tokens) == (1, [], 0)
        assert good.step_index == 2 and len(good.tokens) == 2
        dead = await redis.xrange(KEYS.dead)
        assert [fields[b"source"].decode() for _, fields in dead] == [KEYS.plans(WORKER)] * 2
        plan = decode_worker_message(dead[1][1][b"data"])
        assert isinstance(plan, StepPlan) and plan.step_index == 1
        assert b"nobody" in dead[1][1][b"error"]

    run_worker(redis_server.url, model, scenario)


def test_undecodable_plans_go_to_dead_with_a_log_line_and_the_worker_goes_on(redis_server, model):
    # A map nested deeper than msgspec recurses: decoding raises RecursionError.
    nested_map = b"\x81\xa1a" * 5_000 + b"\xc0"

    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        with capture_logs() as logs:
            await redis.xadd(KEYS.plans(WORKER), {MESSAGE_FIELD: nested_map})
            await redis.xadd(KEYS.plans(WORKER), {"not_the_message_field": b"x"})
            await scheduler.send(admit(1))
            output = await scheduler.result()
        assert output.step_index == 1 and len(output.tokens) == 2
        dead = [fields for _, fields in await redis.xrange(KEYS.dead)]
        assert [fields[b"source"].decode() for fields in dead] == [KEYS.plans(WORKER)] * 2
        assert [fields[b"data"] for fields in dead] == [nested_map, b""]
        lines = [log for log in logs if log["event"] == "undecodable_entry"]
        assert [(log["stream"], log["log_level"]) for log in lines] == [
            (KEYS.plans(WORKER), "warning")
        ] * 2

    run_worker(redis_server.url, model, scenario)


def test_plans_left_by_an_earlier_incarnation_are_not_run(redis_server, model):
    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        await scheduler.send(admit(2))
        assert (await scheduler.result()).step_index == 2

    client = redis.Redis.from_url(redis_server.url)
    client.xgroup_create(KEYS.plans(WORKER), WORKER_GROUP, id="0", mkstream=True)
    client.xadd(KEYS.plans(WORKER), {MESSAGE_FIELD: b"\x93 stale"})
    run_worker(redis_server.url, model, scenario)
    assert not client.exists(KEYS.dead)


def test_a_new_scheduler_epoch_makes_the_worker_join_again(redis_server, model):
    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        await redis.incr(KEYS.epoch)  # a scheduler restarted
        deadline = time.monotonic() + 5
        while await redis.xlen(KEYS.control) < 2:
            assert time.monotonic() < deadline, "the worker did not join again"
            await asyncio.sleep(0.05)
        _, fields = (await redis.xrange(KEYS.control))[1]
        assert isinstance(decode_control_message(fields[MESSAGE_FIELD.encode()]), WorkerJoined)

    redis.Redis.from_url(redis_server.url).set(KEYS.epoch, 1)
    run_worker(redis_server.url, model, scenario, heartbeat_s=0.1)


@pytest.mark.parametrize("value", ["0", "-1", "9", "1e9", "three"])
def test_a_lookahead_out_of_range_is_a_usage_error(value: str) -> None:
    with pytest.raises(SystemExit):
        parse_settings([f"--max-inflight={value}"])


def test_the_lookahead_flag_takes_1_to_the_most() -> None:
    assert parse_settings([]).max_inflight == 3
    assert parse_settings(["--max-inflight=1"]).max_inflight == 1
    assert parse_settings([f"--max-inflight={MAX_INFLIGHT}"]).max_inflight == MAX_INFLIGHT
