"""The scheduler actor against a real redis-server; the test plays workers and gateways."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from structlog.testing import capture_logs

from scheduler_actor.actor import SchedulerActor
from scheduler_actor.cost_model import CostModel
from scheduler_actor.sim_worker import SimulatedWorker
from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import (
    CancelRequest,
    RequestAdopted,
    RequestRecord,
    RequestRejected,
    SampledToken,
    SamplingParams,
    StepOutput,
    StepPlan,
    SubmitRequest,
    WorkerJoined,
    WorkerLeft,
    decode_gateway_message,
    decode_worker_message,
    encode,
)
from shared.redis_streams import connect, send_message
from shared.request_log import queue_checkpoint, queue_record, read_request_log
from shared.settings import RedisSettings, SchedulerSettings
from tests.journal import queue_journal_entry

KEYS = RedisKeys("test")
GATEWAY = "gw1"

Scenario = Callable[[aioredis.Redis], Awaitable[None]]


def run_scenario(url: str, scenario: Scenario, **overrides: float) -> None:
    """Run the actor and ``scenario`` side by side; stop the actor when it ends."""

    async def main() -> None:
        redis_settings = RedisSettings(url=url, prefix=KEYS.prefix)
        settings = dataclasses.replace(SchedulerSettings(redis=redis_settings), **overrides)
        actor_redis, test_redis = connect(url), connect(url)
        stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(SchedulerActor(settings, actor_redis).run(stop))
                try:
                    await asyncio.wait_for(scenario(test_redis), timeout=15)
                finally:
                    stop.set()
        finally:
            await actor_redis.aclose()
            await test_redis.aclose()

    asyncio.run(main())


async def join(redis: aioredis.Redis, worker_id: str, num_blocks: int = 64) -> None:
    """Be a live worker: heartbeat key, then WorkerJoined."""
    await redis.set(KEYS.worker_heartbeat(worker_id), b"1", ex=30)
    await send_message(redis, KEYS.control, WorkerJoined(worker_id, num_blocks, 16, 2))


async def submit(
    redis: aioredis.Redis, request_id: str, num_prompt_tokens: int = 5, max_tokens: int = 3
) -> None:
    """Be a gateway submitting a request."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt_ids = list(range(1, num_prompt_tokens + 1))
    message = SubmitRequest(request_id, GATEWAY, "tenant", prompt_ids, sampling)
    await send_message(redis, KEYS.requests, message)


class PlanReader:
    """Reads one worker's plan stream from the start, without a consumer group."""

    def __init__(self, redis: aioredis.Redis, worker_id: str) -> None:
        self.redis = redis
        self.stream = KEYS.plans(worker_id)
        self.last_id = "0-0"

    async def next(self, timeout_s: float = 5.0) -> StepPlan:
        """The next plan; fails the test after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = await self.redis.xread({self.stream: self.last_id}, count=1, block=100)
            if reply:
                entry_id, fields = reply[0][1][0]
                self.last_id = entry_id.decode()
                plan = decode_worker_message(fields[MESSAGE_FIELD.encode()])
                assert isinstance(plan, StepPlan)
                return plan
        raise AssertionError(f"no plan on {self.stream} within {timeout_s} s")


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` until it holds."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_plans_flow_until_every_request_finishes(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        await join(redis, "w1")
        for number in range(3):
            await submit(redis, f"r{number}", num_prompt_tokens=5 + number, max_tokens=4)
        worker = SimulatedWorker("w1", 64, 16, CostModel())
        plans = PlanReader(redis, "w1")
        generated: dict[str, list[int]] = {}
        admitted = set()
        while sum(len(indices) for indices in generated.values()) < 12:
            plan = await plans.next()
            assert plan.epoch == int(await redis.get(KEYS.epoch))
            admitted |= {spec.request_id for spec in plan.new_requests}
            assert all(spec.gateway_id == GATEWAY for spec in plan.new_requests)
            output, _ = worker.execute(plan)
            for token in output.tokens:
                generated.setdefault(token.request_id, []).append(token.index)
            await send_message(redis, KEYS.results, output)
        assert admitted == {"r0", "r1", "r2"}
        assert generated == {f"r{n}": [0, 1, 2, 3] for n in range(3)}

    run_scenario(redis_server.url, scenario)


def test_two_plans_are_in_flight_before_any_result(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        await join(redis, "w1")
        await submit(redis, "r0", max_tokens=8)
        plans = PlanReader(redis, "w1")
        first, second = await plans.next(), await plans.next()
        assert [spec.request_id for spec in first.new_requests] == ["r0"]
        assert second.decode_request_ids == ["r0"] and second.step_index > first.step_index

    run_scenario(redis_server.url, scenario)


def test_cancel_releases_the_request_in_the_next_plan(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        await join(redis, "w1")
        await submit(redis, "r0", max_tokens=50)
        worker = SimulatedWorker("w1", 64, 16, CostModel())
        plans = PlanReader(redis, "w1")
        for _ in range(2):
            await send_message(redis, KEYS.results, worker.execute(await plans.next())[0])
        await send_message(redis, KEYS.control, CancelRequest("r0"))
        # Releases ride on the next plan with work in it.
        await submit(redis, "r1")
        for _ in range(4):
            plan = await plans.next()
            if "r0" in plan.released_request_ids:
                return
            await send_message(redis, KEYS.results, worker.execute(plan)[0])
        raise AssertionError("r0 was never released")

    run_scenario(redis_server.url, scenario)


async def rejections(pubsub: aioredis.client.PubSub, count: int) -> list[RequestRejected]:
    """The next ``count`` RequestRejected on the gateway channel."""
    found: list[RequestRejected] = []
    deadline = time.monotonic() + 5
    while len(found) < count and time.monotonic() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is not None:
            decoded = decode_gateway_message(message["data"])
            assert isinstance(decoded, RequestRejected)
            found.append(decoded)
    return found


def test_bad_requests_are_rejected_on_the_gateway_channel(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        pubsub = redis.pubsub()
        await pubsub.subscribe(KEYS.tokens(GATEWAY))
        await join(redis, "w1", num_blocks=4)  # 64 K/V slots
        await wait_for(lambda: redis.exists(KEYS.ready))
        await submit(redis, "too_long", num_prompt_tokens=60, max_tokens=10)
        await submit(redis, "empty_budget", max_tokens=0)
        await submit(redis, "ok")
        # The same submit again (a gateway re-sent its transaction): dropped, and
        # the live request is not rejected.
        await submit(redis, "ok")
        found = await rejections(pubsub, 2)
        assert [(r.request_id, r.code) for r in found] == [
            ("too_long", "prompt_too_long"),
            ("empty_budget", "invalid_request"),
        ]

        async def only_the_live_submit_left() -> bool:
            return int(await redis.xlen(KEYS.requests)) == 1

        await wait_for(only_the_live_submit_left)
        assert await rejections(pubsub, 1) == []
        await pubsub.aclose()

    run_scenario(redis_server.url, scenario)


def test_a_full_queue_rejects_with_queue_full(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        pubsub = redis.pubsub()
        await pubsub.subscribe(KEYS.tokens(GATEWAY))
        for number in range(3):  # no worker: everybody waits
            await submit(redis, f"r{number}")
        found = await rejections(pubsub, 1)
        assert [(r.request_id, r.code) for r in found] == [("r2", "queue_full")]
        await pubsub.aclose()

    run_scenario(redis_server.url, scenario, max_waiting=2)


def test_ready_key_follows_worker_membership(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        assert not await redis.exists(KEYS.ready)
        await join(redis, "w1")
        await wait_for(lambda: redis.exists(KEYS.ready))
        assert 0 < await redis.ttl(KEYS.ready) <= 3
        await send_message(redis, KEYS.control, WorkerLeft("w1"))
        await wait_for(lambda: _missing(redis, KEYS.ready))

    run_scenario(redis_server.url, scenario)


async def _missing(redis: aioredis.Redis, key: str) -> bool:
    return not await redis.exists(key)


def test_a_silent_worker_is_lost_and_its_requests_move(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        await join(redis, "w1")
        await submit(redis, "r0", max_tokens=20)
        first = await PlanReader(redis, "w1").next()
        assert [spec.request_id for spec in first.new_requests] == ["r0"]
        await join(redis, "w2")
        await redis.delete(KEYS.worker_heartbeat("w1"))  # w1 dies silently
        moved = await PlanReader(redis, "w2").next(timeout_s=5)
        assert [spec.request_id for spec in moved.new_requests] == ["r0"]

    run_scenario(redis_server.url, scenario, worker_timeout_s=0.5)


def test_undecodable_entries_go_to_dead_and_the_actor_goes_on(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        await redis.xadd(KEYS.requests, {MESSAGE_FIELD: b"\xc1 not msgpack"})
        await redis.xadd(KEYS.requests, {"wrong_field": b"x"})
        await redis.xadd(KEYS.results, {MESSAGE_FIELD: b"\x93\x01\x02\x03"})
        await wait_for(lambda: _length_at_least(redis, KEYS.dead, 3))
        dead = await redis.xrange(KEYS.dead)
        sources = sorted(fields[b"source"].decode() for _, fields in dead)
        assert sources == [KEYS.requests, KEYS.requests, KEYS.results]
        assert all(fields[b"error"] for _, fields in dead)
        await join(redis, "w1")
        await submit(redis, "r0")
        plan = await PlanReader(redis, "w1").next()
        assert [spec.request_id for spec in plan.new_requests] == ["r0"]
        # The dead entries are acknowledged; the live request's submit stays
        # pending until it ends (a new scheduler would recover it from there).
        pending = await redis.xpending_range(KEYS.requests, "scheduler", "-", "+", 10)
        assert len(pending) == 1

    run_scenario(redis_server.url, scenario)


async def _length_at_least(redis: aioredis.Redis, stream: str, length: int) -> bool:
    return bool(await redis.exists(stream)) and await redis.xlen(stream) >= length


def test_results_of_unknown_plans_are_ignored(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        await send_message(redis, KEYS.results, StepOutput("ghost", 1, 99))
        await join(redis, "w1")
        await submit(redis, "r0")
        plan = await PlanReader(redis, "w1").next()
        assert [spec.request_id for spec in plan.new_requests] == ["r0"]

    run_scenario(redis_server.url, scenario)


# A map nested deeper than msgspec recurses: decoding raises RecursionError, not DecodeError.
NESTED_MAP = b"\x81\xa1a" * 5_000 + b"\xc0"


def test_every_stream_dead_letters_what_does_not_decode_with_a_log_line(redis_server):
    """requests, control and results alike: garbage and a too deeply nested map go to
    dead with their source, one log line each, and the scheduler keeps planning."""
    streams = (KEYS.requests, KEYS.control, KEYS.results)

    async def scenario(redis: aioredis.Redis) -> None:
        with capture_logs() as logs:
            for stream in streams:
                await redis.xadd(stream, {MESSAGE_FIELD: b"\xc1 not msgpack"})
                await redis.xadd(stream, {MESSAGE_FIELD: NESTED_MAP})
            await wait_for(lambda: _length_at_least(redis, KEYS.dead, 6))
            await join(redis, "w1")
            await submit(redis, "r0")
            plan = await PlanReader(redis, "w1").next()
        assert [spec.request_id for spec in plan.new_requests] == ["r0"]
        dead = await redis.xrange(KEYS.dead)
        assert sorted(fields[b"source"].decode() for _, fields in dead) == sorted(streams * 2)
        assert sorted(fields[b"data"] for _, fields in dead) == sorted(
            [b"\xc1 not msgpack", NESTED_MAP] * 3
        )
        lines = [log["stream"] for log in logs if log["event"] == "undecodable_entry"]
        assert sorted(lines) == sorted(streams * 2)
        assert all(
            log["log_level"] == "warning" for log in logs if log["event"] == "undecodable_entry"
        )

    run_scenario(redis_server.url, scenario)


def test_a_new_incarnation_recovers_pending_requests_with_their_logged_tokens(redis_server):
    """The first scheduler reads three submits and dies without finishing them;
    the second recovers the two unfinished ones with the tokens their logs hold
    (recompute from there) and lets go of the one whose log says it ended."""

    async def first(redis: aioredis.Redis) -> None:
        pipe = redis.pipeline(transaction=True)
        for number, max_tokens in enumerate((4, 4, 2)):
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            message = SubmitRequest(f"r{number}", GATEWAY, "tenant", [1, 2, 3], sampling)
            queue_record(pipe, KEYS, RequestRecord(submit=message, client_id=f"c{number}"))
        await pipe.execute()
        for number, max_tokens in enumerate((4, 4, 2)):
            await submit(redis, f"r{number}", num_prompt_tokens=3, max_tokens=max_tokens)
        # No worker: the requests wait, read but not finished.
        await wait_for(lambda: _num_pending(redis, 3))

    run_scenario(redis_server.url, first)

    async def second(redis: aioredis.Redis) -> None:
        # Tokens sent before the crash: two of r0 (one checkpointed into its log,
        # one only in the journal), both of r2 (journal only; r2 is thus finished).
        pipe = redis.pipeline(transaction=True)
        queue_checkpoint(pipe, KEYS, [SampledToken("r0", 7, 0)], None)
        queue_journal_entry(pipe, KEYS, "w-old", [SampledToken("r0", 8, 1)])
        r2_tokens = [SampledToken("r2", 5, 0), SampledToken("r2", 6, 1)]
        queue_journal_entry(pipe, KEYS, "w-old", r2_tokens)
        await pipe.execute()
        await join(redis, "w1")
        plan = await PlanReader(redis, "w1").next()
        specs = {spec.request_id: spec for spec in plan.new_requests}
        assert set(specs) == {"r0", "r1"}
        assert specs["r0"].num_generated == 2 and specs["r0"].num_prompt_tokens == 5
        assert specs["r1"].num_generated == 0
        chunks = {chunk.request_id: chunk.token_ids for chunk in plan.prefill_chunks}
        assert chunks["r0"] == [1, 2, 3, 7, 8]
        assert plan.epoch == 2
        await wait_for(lambda: _num_pending(redis, 2))

    with capture_logs() as logs:
        run_scenario(redis_server.url, second)
    [started] = [log for log in logs if log["event"] == "scheduler_started"]
    assert started["num_recovered"] == 2 and started["epoch"] == 2


async def _num_pending(redis: aioredis.Redis, count: int) -> bool:
    try:
        pending = await redis.xpending(KEYS.requests, "scheduler")
    except ResponseError:  # NOGROUP: the actor has not started its incarnation yet
        return False
    return bool(pending["pending"] == count)


def test_requests_of_a_dead_gateway_are_cancelled_unless_resumed_elsewhere(redis_server):
    """gw-dead never beats: its request is cancelled after the orphan timeout,
    and its log says so; one taken over by a live gateway (RequestAdopted) and
    one of a live gateway keep running."""

    async def scenario(redis: aioredis.Redis) -> None:
        await redis.set(KEYS.gateway_heartbeat("gw-live"), b"1", ex=30)
        pipe = redis.pipeline(transaction=True)
        for request_id, gateway_id in (
            ("orphan", "gw-dead"),
            ("moved", "gw-dead"),
            ("kept", "gw-live"),
        ):
            sampling = SamplingParams(max_tokens=50, ignore_eos=True)
            message = SubmitRequest(request_id, gateway_id, "tenant", [1, 2, 3], sampling)
            queue_record(pipe, KEYS, RequestRecord(submit=message, client_id=request_id))
            pipe.xadd(KEYS.requests, {MESSAGE_FIELD: encode(message)})
        await pipe.execute()
        await wait_for(lambda: _num_pending(redis, 3))  # read by the scheduler
        await send_message(redis, KEYS.control, RequestAdopted("moved", "gw-live"))
        await wait_for(lambda: _num_pending(redis, 2), timeout_s=10)
        orphan_log = await read_request_log(redis, KEYS, "orphan")
        assert orphan_log is not None and orphan_log.ended_after == 0
        for request_id in ("moved", "kept"):
            log = await read_request_log(redis, KEYS, request_id)
            assert log is not None and log.ended_after is None

    with capture_logs() as logs:
        run_scenario(redis_server.url, scenario, orphan_timeout_s=0.5)
    [cancelled] = [log for log in logs if log["event"] == "orphans_cancelled"]
    assert cancelled["gateway_id"] == "gw-dead" and cancelled["num_requests"] == 1


def test_a_conditional_cancel_stands_only_while_its_gateway_serves_the_request(redis_server):
    """A gateway whose client left without a resume cancels on condition: the
    scheduler drops the request (and logs its end) unless another gateway took
    it over meanwhile."""

    async def scenario(redis: aioredis.Redis) -> None:
        for gateway_id in ("gw-a", "gw-b"):
            await redis.set(KEYS.gateway_heartbeat(gateway_id), b"1", ex=30)
        pipe = redis.pipeline(transaction=True)
        for request_id in ("left", "moved"):
            sampling = SamplingParams(max_tokens=50, ignore_eos=True)
            message = SubmitRequest(request_id, "gw-a", "tenant", [1, 2, 3], sampling)
            queue_record(pipe, KEYS, RequestRecord(submit=message, client_id=request_id))
            pipe.xadd(KEYS.requests, {MESSAGE_FIELD: encode(message)})
        await pipe.execute()
        await wait_for(lambda: _num_pending(redis, 2))
        await send_message(redis, KEYS.control, RequestAdopted("moved", "gw-b"))
        for request_id in ("left", "moved"):
            await send_message(redis, KEYS.control, CancelRequest(request_id, gateway_id="gw-a"))
        await wait_for(lambda: _num_pending(redis, 1))
        left = await read_request_log(redis, KEYS, "left")
        moved = await read_request_log(redis, KEYS, "moved")
        assert left is not None and left.ended_after == 0
        assert moved is not None and moved.ended_after is None
        await asyncio.sleep(0.3)
        assert await _num_pending(redis, 1)

    run_scenario(redis_server.url, scenario)
