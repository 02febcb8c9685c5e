"""``kill -9`` of a worker in the middle of generation."""

from __future__ import annotations

import asyncio
import time

from websockets.asyncio.client import connect

from tests.faults.cluster import (
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


def test_a_killed_workers_requests_finish_on_another_each_token_once(cluster: Cluster) -> None:
    cluster.start_service()
    url = cluster.ws_url("g0")
    undisturbed = reference_run(url, MAX_TOKENS)
    cluster.start_worker("w1")
    cluster.wait_ready(["w0", "w1"])

    async def disturbed() -> tuple[dict, float]:
        async with connect(url) as socket:
            streams = await send_requests(socket, MAX_TOKENS)
            await read_into(socket, streams, time.monotonic() + 60, each_has_tokens(4))
            killed_at_s = time.monotonic()
            cluster.kill("w0")
            await read_into(socket, streams, time.monotonic() + 120)
        return streams, killed_at_s

    streams, killed_at_s = asyncio.run(disturbed())
    assert_exactly_once(streams, MAX_TOKENS)
    assert_same_texts(streams, undisturbed)
    [lost] = cluster.log_events("scheduler", "worker_lost", worker_id="w0")
    num_requeued = lost["num_requeued"]
    assert num_requeued >= 1, lost
    print(
        f"\nworker kill: {len(streams)} requests, {num_requeued} on the killed worker, "
        f"{sum(len(s.seqs) for s in streams.values())} tokens; "
        f"longest pause {longest_gap_s(streams):.2f} s; "
        f"all done {seconds_to_last_token(streams, killed_at_s):.2f} s "
        "after the kill"
    )
