"""No request's data ends the worker: a request that fails in a step, or every
request of a plan that raised, is rejected to its gateway (code ``internal``)
and ended in its log, in the step's transaction; the batch's other requests
finish and the worker keeps serving (real redis-server, tiny model)."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from gpu_worker.engine import STEP_FAILED_MESSAGE, Engine
from gpu_worker.llama import LlamaModel
from gpu_worker.model_loading import load_model
from shared.messages import (
    MAX_SEED,
    MAX_TOP_K,
    PrefillChunk,
    RequestFailed,
    RequestFailure,
    RequestRecord,
    RequestRejected,
    RequestSpec,
    SamplingParams,
    StepPlan,
    SubmitRequest,
    TokenBatch,
    decode_gateway_message,
)
from shared.request_log import queue_record, read_request_log
from shared.settings import DEFAULT_LOG_RETENTION_S
from tests.gpu_worker.plans import grants_up_front
from tests.gpu_worker.test_actor import KEYS, WORKER, Scheduler, decode, run_worker
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)
EXTREME = SamplingParams(
    temperature=5e-324, top_p=1e-50, top_k=MAX_TOP_K, seed=MAX_SEED, max_tokens=3, ignore_eos=True
)
PROMPTS = {"ok": [5, 9, 11, 40], "extreme": [7, 3, 22], "bad": [4, TINY_VOCAB_SIZE + 1, 6]}
SAMPLING = {"ok": GREEDY, "extreme": EXTREME, "bad": GREEDY}
GATEWAYS = {"ok": "gw1", "extreme": "gw2", "bad": "gw2"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(model_dir, device="cpu", dtype="float32")


def _admit(step_index: int, request_ids: list[str]) -> StepPlan:
    specs = [
        RequestSpec(rid, len(PROMPTS[rid]), SAMPLING[rid], gateway_id=GATEWAYS[rid])
        for rid in request_ids
    ]
    return StepPlan(
        worker_id=WORKER,
        epoch=1,
        step_index=step_index,
        new_requests=specs,
        prefill_chunks=[PrefillChunk(rid, PROMPTS[rid], 0) for rid in request_ids],
        block_grants=grants_up_front(specs),
    )


async def _log_requests(redis: aioredis.Redis, request_ids: list[str]) -> None:
    """Start each request's log as its gateway would."""
    pipe = redis.pipeline(transaction=True)
    for rid in request_ids:
        submit = SubmitRequest(rid, GATEWAYS[rid], "default", PROMPTS[rid], SAMPLING[rid])
        queue_record(pipe, KEYS, RequestRecord(submit=submit, client_id=rid))
    await pipe.execute()


async def _gateway_messages(
    scheduler: Scheduler, until: set[str]
) -> list[tuple[str, TokenBatch | RequestRejected]]:
    """Pub/sub messages until every request in ``until`` has finished or been rejected."""
    found: list[tuple[str, TokenBatch | RequestRejected]] = []
    ended: set[str] = set()
    deadline = time.monotonic() + 5
    while not until <= ended and time.monotonic() < deadline:
        message = await scheduler.pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is None:
            continue
        decoded = decode_gateway_message(message["data"])
        found.append((message["channel"].decode(), decoded))
        if isinstance(decoded, RequestRejected):
            ended.add(decoded.request_id)
        else:
            ended |= {t.request_id for t in decoded.tokens if t.finish_reason is not None}
    return found


def test_a_failing_request_is_rejected_alone_and_the_batch_finishes(redis_server, model):
    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        await _log_requests(redis, list(PROMPTS))
        await scheduler.send(_admit(1, list(PROMPTS)))
        # The scheduler has not seen the failure yet: it plans a decode of "bad" too.
        await scheduler.send(decode(2, ["ok", "extreme", "bad"]))
        await scheduler.send(decode(3, ["ok", "extreme"]))
        outputs = [await scheduler.result() for _ in range(3)]
        assert [o.step_index for o in outputs] == [1, 2, 3]
        [failure] = outputs[0].failed
        assert failure.request_id == "bad" and "vocabulary" in failure.message
        assert [o.failed for o in outputs[1:]] == [[], []]
        assert sorted(outputs[-1].finished_request_ids) == ["extreme", "ok"]
        messages = await _gateway_messages(scheduler, {"ok", "extreme", "bad"})
        rejected = [(ch, m) for ch, m in messages if isinstance(m, RequestRejected)]
        assert rejected == [
            (KEYS.tokens("gw2"), RequestRejected("bad", code="internal", message=failure.message))
        ]
        tokens = [t for _, m in messages if isinstance(m, TokenBatch) for t in m.tokens]
        assert sorted((t.request_id, t.index) for t in tokens) == [
            (rid, i) for rid in ("extreme", "ok") for i in range(3)
        ]
        # Its log is ended, kept for the short retention only.
        log = await read_request_log(redis, KEYS, "bad")
        assert log is not None and log.is_finished
        assert log.failure == RequestFailed("bad", code="internal", message=failure.message)
        assert 0 < await redis.ttl(KEYS.request_log("bad")) <= DEFAULT_LOG_RETENTION_S
        # The worker is alive and serves the next request.
        assert await redis.exists(KEYS.worker_heartbeat(WORKER))
        await scheduler.send(_admit(4, ["ok"]))
        assert [t.request_id for t in (await scheduler.result()).tokens] == ["ok"]

    run_worker(redis_server.url, model, scenario)


def test_a_plan_that_raises_fails_its_requests_and_the_worker_goes_on(
    redis_server, model, monkeypatch: pytest.MonkeyPatch
):
    real_begin = Engine.begin_step

    def begin_that_breaks_once(engine: Engine, plan: StepPlan):
        if plan.step_index == 1:
            raise RuntimeError("something nobody expected")
        return real_begin(engine, plan)

    monkeypatch.setattr(Engine, "begin_step", begin_that_breaks_once)

    async def scenario(redis: aioredis.Redis, scheduler: Scheduler) -> None:
        await scheduler.joined()
        await _log_requests(redis, ["ok", "extreme"])
        await scheduler.send(_admit(1, ["ok", "extreme"]))
        failed = await scheduler.result()
        assert failed.failed == [
            RequestFailure("ok", STEP_FAILED_MESSAGE),
            RequestFailure("extreme", STEP_FAILED_MESSAGE),
        ]
        messages = await _gateway_messages(scheduler, {"ok", "extreme"})
        assert sorted((ch, m.request_id) for ch, m in messages) == [
            (KEYS.tokens("gw1"), "ok"),
            (KEYS.tokens("gw2"), "extreme"),
        ]
        assert all(isinstance(m, RequestRejected) and m.code == "internal" for _, m in messages)
        for rid in ("ok", "extreme"):
            log = await read_request_log(redis, KEYS, rid)
            assert log is not None and log.failure is not None
        # The plan is kept in dead for a human; the worker runs the next plan.
        assert await redis.xlen(KEYS.dead) == 1
        await scheduler.send(_admit(2, ["ok", "extreme"]))
        output = await scheduler.result()
        assert sorted(t.request_id for t in output.tokens) == ["extreme", "ok"]

    run_worker(redis_server.url, model, scenario)
