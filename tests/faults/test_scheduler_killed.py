"""``kill -9`` of the scheduler: a new one recovers every unfinished request."""

from __future__ import annotations

import asyncio
import time

from websockets.asyncio.client import connect

from shared.keys import MESSAGE_FIELD
from shared.messages import (
    PrefillChunk,
    RequestSpec,
    SamplingParams,
    StepPlan,
    decode_step_output,
)
from shared.redis_streams import send_message
from tests.faults.cluster import (
    KEYS,
    Cluster,
    assert_exactly_once,
    assert_same_texts,
    each_has_tokens,
    longest_gap_s,
    read_into,
    reference_run,
    seconds_to_last_token,
    send_requests,
)

MAX_TOKENS = 24


def test_a_restarted_scheduler_recovers_every_request_and_old_plans_are_fenced(
    cluster: Cluster,
) -> None:
    cluster.start_service()
    url = cluster.ws_url("g0")
    undisturbed = reference_run(url, MAX_TOKENS)

    async def disturbed() -> tuple[dict, float]:
        async with connect(url) as socket:
            streams = await send_requests(socket, MAX_TOKENS)
            await read_into(socket, streams, time.monotonic() + 60, each_has_tokens(4))
            killed_at_s = time.monotonic()
            cluster.kill("scheduler")
            cluster.start_scheduler()
            await read_into(socket, streams, time.monotonic() + 120)
        return streams, killed_at_s

    streams, killed_at_s = asyncio.run(disturbed())
    assert_exactly_once(streams, MAX_TOKENS)
    assert_same_texts(streams, undisturbed)
    started = cluster.log_events("scheduler", "scheduler_started")
    assert [entry["epoch"] for entry in started] == [1, 2]
    assert started[1]["num_recovered"] == len(streams)
    # The worker moved to the new epoch once, dropping what the dead scheduler had
    # placed on it (every request of this test ran there).
    [new_epoch] = cluster.log_events("w0", "new_epoch", epoch=2)
    assert new_epoch["num_dropped"] >= 1, new_epoch
    assert not cluster.log_events("w0", "new_epoch", epoch=3)

    # A plan of the dead incarnation (epoch 1) reaching the worker now is never run.
    client = cluster.redis()
    newest = client.xrevrange(KEYS.results, count=1)
    journal_end = newest[0][0] if newest else b"0-0"
    stale = StepPlan(
        worker_id="w0",
        epoch=1,
        step_index=10_000,
        new_requests=[RequestSpec("ghost", 3, SamplingParams(max_tokens=2))],
        prefill_chunks=[PrefillChunk("ghost", [1, 2, 3], 0)],
    )
    asyncio.run(_send(cluster, stale))
    deadline = time.monotonic() + 10
    while not cluster.log_events("w0", "stale_plan_skipped", epoch=1, step_index=10_000):
        assert time.monotonic() < deadline, "the stale plan was not skipped"
        time.sleep(0.1)
    assert not client.exists(KEYS.request_log("ghost"))
    # Nothing of it reached the journal (the scheduler trims it meanwhile, so
    # what is there is not counted; only what came after is read).
    later = client.xrange(KEYS.results, b"(" + journal_end, "+")
    assert all(
        decode_step_output(fields[MESSAGE_FIELD.encode()]).step_index != 10_000
        for _, fields in later
    )
    print(
        f"\nscheduler kill: {len(streams)} requests recovered, "
        f"longest pause {longest_gap_s(streams):.2f} s; all done "
        f"{seconds_to_last_token(streams, killed_at_s):.2f} s after the kill"
    )


async def _send(cluster: Cluster, plan: StepPlan) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(cluster.redis_url)
    try:
        await send_message(client, KEYS.plans("w0"), plan)
    finally:
        await client.aclose()
