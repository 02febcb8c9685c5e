"""``kill -9`` of a gateway: the client resumes on another one."""

from __future__ import annotations

import asyncio
import json
import time

from websockets.asyncio.client import connect

from tests.faults.cluster import (
    Cluster,
    Stream,
    assert_exactly_once,
    assert_same_texts,
    each_has_tokens,
    read_into,
    reference_run,
    seconds_to_last_token,
    send_requests,
)

MAX_TOKENS = 24


def test_a_client_resumes_on_another_gateway_losing_and_repeating_nothing(
    cluster: Cluster,
) -> None:
    cluster.start_service(gateway_ids=("g0", "g1"))
    undisturbed = reference_run(cluster.ws_url("g1"), MAX_TOKENS)

    async def disturbed() -> tuple[dict[str, Stream], float]:
        async with connect(cluster.ws_url("g0")) as socket:
            streams = await send_requests(socket, MAX_TOKENS)
            await read_into(socket, streams, time.monotonic() + 60, each_has_tokens(3))
            killed_at_s = time.monotonic()
            cluster.kill("g0")
            # Whatever was already on its way still arrives; then the socket is dead.
            await read_into(socket, streams, time.monotonic() + 5)
        async with connect(cluster.ws_url("g1")) as socket:
            for client_id, stream in streams.items():
                frame = {"type": "resume", "request_id": stream.request_id, "id": client_id}
                await socket.send(json.dumps({**frame, "after_seq": stream.last_seq}))
            await read_into(socket, streams, time.monotonic() + 120)
        return streams, killed_at_s

    streams, killed_at_s = asyncio.run(disturbed())
    assert_exactly_once(streams, MAX_TOKENS)
    assert_same_texts(streams, undisturbed)
    # g1 served each resume from the request's log, each request once.
    taken_over = cluster.log_events("g1", "request_taken_over")
    assert sorted(entry["request_id"] for entry in taken_over) == sorted(
        stream.request_id for stream in streams.values()
    )
    print(
        f"\ngateway kill: {len(streams)} requests resumed on another gateway; all done "
        f"{seconds_to_last_token(streams, killed_at_s):.2f} s after the kill"
    )
