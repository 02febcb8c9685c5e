"""redis-server restarted (append-only file on) while requests run."""

from __future__ import annotations

import asyncio
import time

from websockets.asyncio.client import connect

from tests.faults.cluster import (
    PROMPTS,
    Cluster,
    Stream,
    assert_exactly_once,
    assert_same_texts,
    each_has_tokens,
    generate_frame,
    longest_gap_s,
    read_into,
    reference_run,
    run_requests,
    seconds_to_last_token,
    send_requests,
)

MAX_TOKENS = 24
NO_HANG_S = 90.0


def test_every_actor_rides_out_a_redis_restart_and_no_request_hangs(cluster: Cluster) -> None:
    cluster.start_service()
    url = cluster.ws_url("g0")
    undisturbed = reference_run(url, MAX_TOKENS)

    async def disturbed() -> tuple[dict[str, Stream], float]:
        async with connect(url) as socket:
            streams = await send_requests(socket, MAX_TOKENS)
            await read_into(socket, streams, time.monotonic() + 60, each_has_tokens(4))
            restarted_at_s = time.monotonic()
            cluster.restart_redis()
            await read_into(socket, streams, time.monotonic() + NO_HANG_S)
        return streams, restarted_at_s

    streams, restarted_at_s = asyncio.run(disturbed())
    # None hangs: each ended with `done` or a clear `error`.
    for stream in streams.values():
        assert stream.ended, f"{stream.client_id} hangs after {stream.seqs}"
        if stream.error is not None:
            assert stream.error["code"] in {"internal", "queue_full"}, stream.error
    completed = {k: s for k, s in streams.items() if s.done is not None}
    assert_exactly_once(completed, MAX_TOKENS)
    assert_same_texts(completed, undisturbed)
    # Every actor is still the same process, and the service serves new requests.
    assert all(cluster.processes[name].poll() is None for name in ("scheduler", "w0", "g0"))
    after = asyncio.run(run_requests(url, 4))
    assert_exactly_once(after, 4)
    print(
        f"\nredis restart: {len(completed)}/{len(streams)} requests completed, "
        f"{len(streams) - len(completed)} ended in an error; longest pause "
        f"{longest_gap_s(streams):.2f} s; all ended "
        f"{seconds_to_last_token(streams, restarted_at_s):.2f} s "
        "after the restart began"
    )


OUTAGE_S = 12.0


def test_a_long_redis_outage_ends_new_requests_in_an_error_and_the_service_comes_back(
    cluster: Cluster,
) -> None:
    """Redis away for longer than the clients' retries (about 9 s): a request
    sent meanwhile gets a clear `error`, those in flight end (done or error),
    and once Redis is back the same processes serve again."""
    cluster.start_service()
    url = cluster.ws_url("g0")

    async def disturbed() -> tuple[dict[str, Stream], dict[str, Stream], float]:
        async with connect(url) as socket, connect(url) as late_socket:
            streams = await send_requests(socket, MAX_TOKENS)
            await read_into(socket, streams, time.monotonic() + 60, each_has_tokens(2))
            stopped_at_s = time.monotonic()
            outage = asyncio.create_task(asyncio.to_thread(cluster.restart_redis, OUTAGE_S))
            await asyncio.sleep(1.0)
            late = {"late": Stream("late")}
            await late_socket.send(generate_frame("late", PROMPTS[0], 4))
            await read_into(late_socket, late, time.monotonic() + NO_HANG_S)
            await read_into(socket, streams, time.monotonic() + NO_HANG_S)
            await outage
        return streams, late, stopped_at_s

    streams, late, stopped_at_s = asyncio.run(disturbed())
    [late_stream] = late.values()
    assert late_stream.ended, "a request sent while Redis was away hangs"
    if late_stream.error is not None:
        assert late_stream.error["code"] == "internal", late_stream.error
    for stream in streams.values():
        assert stream.ended, f"{stream.client_id} hangs after {stream.seqs}"
        assert stream.error is None or stream.error["code"] == "internal", stream.error
        assert stream.seqs == list(range(len(stream.seqs))), stream.seqs
    assert all(cluster.processes[name].poll() is None for name in ("scheduler", "w0", "g0"))
    after = asyncio.run(run_requests(url, 4))
    assert_exactly_once(after, 4)
    completed = sum(stream.done is not None for stream in streams.values())
    print(
        f"\nredis outage {OUTAGE_S:.0f} s: in flight {completed}/{len(streams)} completed; "
        f"request sent during the outage: "
        f"{'error ' + late_stream.error['message'][:60] if late_stream.error else 'completed'}; "
        f"all ended {seconds_to_last_token(streams, stopped_at_s):.1f} s "
        "after Redis stopped"
    )
