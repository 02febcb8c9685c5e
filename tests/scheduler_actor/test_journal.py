"""The scheduler and the step journal: an ended request's tokens go into its log,
a long-running one's are checkpointed, and the journal is trimmed behind them."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

import scheduler_actor.event_handler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import RequestRecord, SampledToken, SamplingParams, SubmitRequest
from shared.redis_streams import connect, send_message
from shared.request_log import (
    RawEntries,
    RequestLog,
    fold_journal,
    queue_checkpoint,
    queue_record,
    read_request_log,
)
from tests.journal import queue_journal_entry
from tests.scheduler_actor.test_actor import (
    GATEWAY,
    KEYS,
    PlanReader,
    join,
    run_scenario,
    wait_for,
)


async def _submit_logged(redis: aioredis.Redis, request_id: str, max_tokens: int) -> None:
    """Be a gateway: the log's record and the submit."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    message = SubmitRequest(request_id, GATEWAY, "tenant", [1, 2, 3, 4], sampling)
    pipe = redis.pipeline(transaction=True)
    queue_record(pipe, KEYS, RequestRecord(submit=message, client_id="c"))
    await pipe.execute()
    await send_message(redis, KEYS.requests, message)


async def _run_steps(
    redis: aioredis.Redis, request_id: str, max_tokens: int, num_steps: int
) -> None:
    """A worker joins, the request is submitted, and the worker runs ``num_steps``
    of its plans, sending each result."""
    await join(redis, "w1")
    await _submit_logged(redis, request_id, max_tokens=max_tokens)
    worker = SimulatedWorker("w1", 64, 16, CostModel())
    plans = PlanReader(redis, "w1")
    for _ in range(num_steps):
        output, _ = worker.execute(await plans.next())
        await send_message(redis, KEYS.results, output)


async def _log_entries(redis: aioredis.Redis, request_id: str) -> RawEntries:
    entries: RawEntries = await redis.xrange(KEYS.request_log(request_id))
    return entries


def test_an_ended_request_is_checkpointed_and_the_journal_trimmed(redis_server):
    async def scenario(redis: aioredis.Redis) -> None:
        await _run_steps(redis, "r", max_tokens=5, num_steps=5)

        async def checkpointed() -> bool:
            return len(await _log_entries(redis, "r")) == 2  # the record, one checkpoint

        await wait_for(checkpointed)
        log = await read_request_log(redis, KEYS, "r")
        assert log is not None and len(log.token_ids) == 5 and log.is_finished
        assert 0 < await redis.ttl(KEYS.request_log("r")) <= 600

        async def trimmed() -> bool:
            return int(await redis.xlen(KEYS.results)) < 5

        # Housekeeping (once a second) trims the journal: every token is logged.
        await wait_for(trimmed, timeout_s=5)
        # The log alone holds the tokens now.
        log = await read_request_log(redis, KEYS, "r")
        assert log is not None and len(log.token_ids) == 5

    run_scenario(redis_server.url, scenario)


def test_a_long_running_request_is_checkpointed_while_it_runs(redis_server, monkeypatch):
    monkeypatch.setattr(scheduler_actor.event_handler, "CHECKPOINT_AGE_MS", 0)

    async def scenario(redis: aioredis.Redis) -> None:
        await _run_steps(redis, "long", max_tokens=50, num_steps=6)

        async def checkpointed() -> bool:
            return len(await _log_entries(redis, "long")) >= 2

        await wait_for(checkpointed, timeout_s=5)
        log = await read_request_log(redis, KEYS, "long")
        assert log is not None and not log.is_finished and len(log.token_ids) == 6
        # Still running: its log keeps the running TTL.
        assert await redis.ttl(KEYS.request_log("long")) > 3600

    run_scenario(redis_server.url, scenario)


@pytest.mark.parametrize("page", [1, 2, 512])
def test_reading_a_record_folds_its_journal_tokens_across_pages(redis_server, page):
    """Entries of other requests between its own; the log's checkpoint and the
    journal overlap; any page size gives the same tokens."""

    async def main() -> None:
        redis = connect(redis_server.url)
        try:
            await redis.delete(KEYS.results, KEYS.request_log("mine"))
            await _submit_logged(redis, "mine", max_tokens=4)
            pipe = redis.pipeline(transaction=True)
            queue_checkpoint(pipe, KEYS, [SampledToken("mine", 10, 0)], None)
            for index, token_id in enumerate((10, 11, 12)):
                queue_journal_entry(pipe, KEYS, "w", [SampledToken("other", 99, index)])
                queue_journal_entry(pipe, KEYS, "w", [SampledToken("mine", token_id, index)])
            await pipe.execute()
            log = await read_request_log(redis, KEYS, "mine")
            assert log is not None and log.token_ids == [10, 11, 12] and not log.is_finished
            # The journal alone, paged: the same tokens.
            fresh = RequestLog(record=log.record, submitted_ms=log.submitted_ms)
            await fold_journal(redis, KEYS, [fresh], page=page)
            assert fresh.token_ids == [10, 11, 12]
            newest = await redis.xrevrange(KEYS.results, count=1)
            assert fresh.journal_entry_id == newest[0][0]
        finally:
            await redis.aclose()

    asyncio.run(main())
