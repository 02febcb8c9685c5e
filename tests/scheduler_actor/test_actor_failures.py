"""The scheduler actor ends requests that fail, against a real redis-server: a
refused submit, a request a worker reported failed, a request on two workers
that failed. Each is told to its gateway where the scheduler is the one to
tell, its log ends with the short retention TTL, and its submit is acked and
deleted (the requests stream keeps only live work)."""

from __future__ import annotations

import redis.asyncio as aioredis

from scheduler_actor.core import WORKERS_LOST_MESSAGE
from scheduler_actor.cost_model import CostModel
from scheduler_actor.sim_worker import SimulatedWorker
from shared.keys import SCHEDULER_GROUP
from shared.messages import (
    RequestFailed,
    RequestFailure,
    RequestRecord,
    RequestRejected,
    SamplingParams,
    StepOutput,
    SubmitRequest,
    decode_gateway_message,
)
from shared.redis_streams import send_message
from shared.request_log import LIVE_TTL_S, queue_record, read_request_log
from shared.settings import DEFAULT_LOG_RETENTION_S
from tests.scheduler_actor.test_actor import (
    GATEWAY,
    KEYS,
    PlanReader,
    join,
    run_scenario,
    wait_for,
)


async def submit_logged(redis: aioredis.Redis, request_id: str, max_tokens: int = 3) -> None:
    """Be a gateway: the log's record and the submit in one transaction."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    message = SubmitRequest(request_id, GATEWAY, "tenant", [1, 2, 3, 4, 5], sampling)
    pipe = redis.pipeline(transaction=True)
    queue_record(pipe, KEYS, RequestRecord(submit=message, client_id=request_id))
    await pipe.execute()
    await send_message(redis, KEYS.requests, message)


async def rejections(pubsub: aioredis.client.PubSub, count: int) -> list[RequestRejected]:
    found: list[RequestRejected] = []
    for _ in range(100):
        if len(found) == count:
            break
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message is not None:
            decoded = decode_gateway_message(message["data"])
            if isinstance(decoded, RequestRejected):
                found.append(decoded)
    return found


async def submit_settled(redis: aioredis.Redis) -> bool:
    """No submit left in the requests stream, none pending in the group."""
    pending = await redis.xpending(KEYS.requests, SCHEDULER_GROUP)
    return await redis.xlen(KEYS.requests) == 0 and pending["pending"] == 0


async def assert_log_failed(redis: aioredis.Redis, request_id: str, code: str) -> RequestFailed:
    log = await read_request_log(redis, KEYS, request_id)
    assert log is not None and log.failure is not None and log.is_finished
    assert log.failure.code == code
    assert 0 < await redis.ttl(KEYS.request_log(request_id)) <= DEFAULT_LOG_RETENTION_S
    return log.failure


def test_a_refused_submit_is_rejected_its_log_ended_short_and_its_submit_deleted(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        pubsub = redis.pubsub()
        await pubsub.subscribe(KEYS.tokens(GATEWAY))
        await join(redis, "w1")
        await submit_logged(redis, "refused")
        assert await redis.ttl(KEYS.request_log("refused")) > LIVE_TTL_S - 60
        [rejected] = await rejections(pubsub, 1)
        assert (rejected.request_id, rejected.code) == ("refused", "queue_full")
        failure = await assert_log_failed(redis, "refused", "queue_full")
        assert failure.message == rejected.message
        await wait_for(lambda: submit_settled(redis))
        await pubsub.aclose()

    run_scenario(redis_server.url, scenario, max_waiting=0)


def test_a_request_a_worker_reported_failed_ends_and_is_never_planned_again(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        await join(redis, "w1")
        worker = SimulatedWorker("w1", 64, 16, CostModel())
        plans = PlanReader(redis, "w1")
        await submit_logged(redis, "poison", max_tokens=5)
        plan = await plans.next()
        assert [spec.request_id for spec in plan.new_requests] == ["poison"]
        output, _ = worker.execute(plan)
        failed = StepOutput(
            "w1", plan.epoch, plan.step_index, failed=[RequestFailure("poison", "bad numbers")]
        )
        assert output.tokens  # what it would have sent had it not failed
        await send_message(redis, KEYS.results, failed)
        await wait_for(lambda: submit_settled(redis))
        await submit_logged(redis, "next", max_tokens=2)
        plan = await plans.next()
        # The overlap plan sent before the failure came back may still name it; no later one does.
        while "next" not in {spec.request_id for spec in plan.new_requests}:
            plan = await plans.next()
        assert "poison" not in plan.decode_request_ids
        assert "poison" not in {c.request_id for c in plan.prefill_chunks}

    run_scenario(redis_server.url, scenario)


def test_a_request_on_two_failed_workers_is_rejected_instead_of_a_third(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        pubsub = redis.pubsub()
        await pubsub.subscribe(KEYS.tokens(GATEWAY))
        await join(redis, "w1")
        plans = PlanReader(redis, "w1")
        await submit_logged(redis, "killer", max_tokens=50)
        for _ in range(2):
            plan = await plans.next()
            while not plan.new_requests:  # the overlap plan of the last placement
                plan = await plans.next()
            assert [spec.request_id for spec in plan.new_requests] == ["killer"]
            await join(redis, "w1")  # it crashed and came back under the same id
        [rejected] = await rejections(pubsub, 1)
        assert rejected == RequestRejected("killer", code="internal", message=WORKERS_LOST_MESSAGE)
        failure = await assert_log_failed(redis, "killer", "internal")
        assert failure.message == WORKERS_LOST_MESSAGE
        await wait_for(lambda: submit_settled(redis))
        await pubsub.aclose()

    run_scenario(redis_server.url, scenario)
