"""redis-server restarted (append-only file on) while requests run."""

from __future__ import annotations

import asyncio
import time

from websockets.asyncio.client import connect

from tests.faults.cluster import (
    KEYS,
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
DOWN_S = 1.0  # well inside the clients' retries (about 9 s)


def test_every_actor_rides_out_a_redis_restart_and_no_request_hangs(cluster: Cluster) -> None:
    """Requests in flight when Redis goes away all complete, exactly once; requests
    sent while it is away complete too, or (only if their submit failed) get a
    clear `internal` error without ever being accepted."""
    cluster.start_service()
    url = cluster.ws_url("g0")
    undisturbed = reference_run(url, MAX_TOKENS)

    async def disturbed() -> tuple[dict[str, Stream], dict[str, Stream], float, float]:
        async with connect(url) as socket, connect(url) as late_socket:
            streams = await send_requests(socket, MAX_TOKENS)
            await read_into(socket, streams, time.monotonic() + 60, each_has_tokens(4))
            restarted_at_s = time.monotonic()
            restart = asyncio.create_task(asyncio.to_thread(cluster.restart_redis, DOWN_S))
            late: dict[str, Stream] = {}
            while not restart.done():
                client_id = f"late{len(late)}"
                late[client_id] = Stream(client_id)
                prompt = PROMPTS[len(late) % len(PROMPTS)]
                await late_socket.send(generate_frame(client_id, prompt, MAX_TOKENS))
                await asyncio.sleep(0.25)
            await restart
            back_at_s = time.monotonic()
            await asyncio.gather(
                read_into(socket, streams, time.monotonic() + NO_HANG_S),
                read_into(late_socket, late, time.monotonic() + NO_HANG_S),
            )
        return streams, late, restarted_at_s, back_at_s

    streams, late, restarted_at_s, back_at_s = asyncio.run(disturbed())
    # Every request in flight spans the restart (tokens before it and after Redis
    # was back) and completes exactly once, with the undisturbed text.
    assert_exactly_once(streams, MAX_TOKENS)
    assert_same_texts(streams, undisturbed)
    for stream in streams.values():
        assert stream.token_times_s[0] < restarted_at_s < back_at_s < stream.token_times_s[-1]
    # Sent while Redis was away: none hangs; an error only for a submit that failed
    # (the gateway accepts first, then answers `internal` if it cannot queue it).
    assert late, "no request was sent during the restart"
    for stream in late.values():
        assert stream.ended, f"{stream.client_id} hangs after {stream.seqs}"
        if stream.error is not None:
            assert stream.error["code"] == "internal", stream.error
            assert not stream.seqs, (stream.client_id, stream.seqs)
            # The submit and the log's first entry go in one transaction: no log,
            # so the scheduler never had it either.
            assert stream.request_id, stream
            assert not cluster.redis().exists(KEYS.request_log(stream.request_id)), stream
    late_completed = {k: s for k, s in late.items() if s.done is not None}
    assert_exactly_once(late_completed, MAX_TOKENS)
    prompt_of = {f"late{i}": f"q{(i + 1) % len(PROMPTS)}" for i in range(len(late))}
    for client_id, stream in late_completed.items():
        assert stream.text == undisturbed[prompt_of[client_id]].text, client_id
    # Every actor is still the same process, and the service serves new requests:
    # those a client sends after the restart (and sends again if told to retry).
    assert all(cluster.processes[name].poll() is None for name in ("scheduler", "w0", "g0"))
    # Once Redis is back, no submit is refused (stale pooled connections included).
    assert_exactly_once(asyncio.run(run_requests(url, 4)), 4)
    print(
        f"\nredis restart ({DOWN_S:.0f} s down): {len(streams)}/{len(streams)} in flight "
        f"completed; sent meanwhile {len(late_completed)}/{len(late)} completed, "
        f"{len(late) - len(late_completed)} refused (submit failed); longest pause "
        f"{longest_gap_s(streams):.2f} s; all ended "
        f"{seconds_to_last_token(streams, restarted_at_s):.2f} s after the restart began"
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
