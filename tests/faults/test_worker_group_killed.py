"""``kill -9`` of one rank of a worker group (pipeline stages) in the middle of
generation: no rank waits for ever, the group counts as one lost worker, and its
requests finish on another worker, each token once, with the group's own text."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from websockets.asyncio.client import connect

from tests.faults.cluster import (
    Cluster,
    assert_exactly_once,
    assert_same_texts,
    each_has_tokens,
    read_into,
    reference_run,
    send_requests,
)

MAX_TOKENS = 24


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().split()[2] == "Z"


def test_a_killed_stage_loses_its_group_and_its_requests_finish_on_another(
    cluster: Cluster,
) -> None:
    cluster.start_redis()
    cluster.start_scheduler()
    cluster.start_worker("w0", "--pipeline-parallel=2")
    cluster.start_gateway("g0")
    cluster.wait_ready(["w0"])
    url = cluster.ws_url("g0")
    # Every answer by the group (its 30 layers in two stages, one process each).
    by_group = reference_run(url, MAX_TOKENS)
    cluster.start_worker("w1")
    cluster.wait_ready(["w0", "w1"])
    ranks = {e["rank"]: e["pid"] for e in cluster.log_events("w0", "group_rank_joined")}
    assert sorted(ranks) == [0, 1], ranks

    async def disturbed() -> dict:
        async with connect(url) as socket:
            streams = await send_requests(socket, MAX_TOKENS)
            await read_into(socket, streams, time.monotonic() + 60, each_has_tokens(4))
            os.kill(ranks[1], signal.SIGKILL)  # the last stage
            await read_into(socket, streams, time.monotonic() + 120)
        return streams

    streams = asyncio.run(disturbed())
    assert_exactly_once(streams, MAX_TOKENS)
    # What the second (one-engine) worker finished equals what the group answered.
    assert_same_texts(streams, by_group)
    [lost] = cluster.log_events("scheduler", "worker_lost", worker_id="w0")
    assert lost["num_requeued"] >= 1, lost
    # The whole group ended: its shell, and the first stage's process with it.
    assert cluster.processes["w0"].wait(timeout=20) != 0
    deadline = time.monotonic() + 10
    while not _gone(ranks[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(ranks[0])
    assert cluster.log_events("w0", "worker_group_lost")
