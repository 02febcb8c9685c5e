"""A client's connection drops mid-answer (a network blip): it reconnects and
`resume`s; the request kept running meanwhile, nothing is lost or repeated."""

from __future__ import annotations

import asyncio
import json
import time

from websockets.asyncio.client import connect

from shared.messages import RequestEnded, RequestFailed, RequestRecord, TokenBatch
from tests.faults.cluster import (
    Cluster,
    Stream,
    assert_exactly_once,
    assert_same_texts,
    each_has_tokens,
    read_into,
    reference_run,
    send_requests,
)

MAX_TOKENS = 24


def test_requests_of_a_dropped_connection_keep_running_until_resumed(cluster: Cluster) -> None:
    cluster.start_service()
    url = cluster.ws_url("g0")
    undisturbed = reference_run(url, MAX_TOKENS)

    async def disturbed() -> dict[str, Stream]:
        async with connect(url) as socket:
            streams = await send_requests(socket, MAX_TOKENS)
            await read_into(socket, streams, time.monotonic() + 60, each_has_tokens(3))
        # The socket is closed; a second later the client is back.
        await asyncio.sleep(1.0)
        async with connect(url) as socket:
            for client_id, stream in streams.items():
                frame = {"type": "resume", "request_id": stream.request_id, "id": client_id}
                await socket.send(json.dumps({**frame, "after_seq": stream.last_seq}))
            await read_into(socket, streams, time.monotonic() + 120)
        return streams

    streams = asyncio.run(disturbed())
    assert_exactly_once(streams, MAX_TOKENS)
    assert_same_texts(streams, undisturbed)
    # Nothing ended them early: no RequestEnded (cancel) or RequestFailed in their
    # logs, and each log holds every token.
    for stream in streams.values():
        entries = cluster.request_log(stream.request_id)
        assert isinstance(entries[0], RequestRecord), entries[:1]
        ends = [entry for entry in entries if isinstance(entry, RequestEnded | RequestFailed)]
        assert ends == [], (stream.client_id, ends)
        indexes = [
            token.index
            for entry in entries
            if isinstance(entry, TokenBatch)
            for token in entry.tokens
        ]
        assert sorted(set(indexes)) == list(range(MAX_TOKENS)), (stream.client_id, indexes)
