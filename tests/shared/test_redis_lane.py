"""A lane (one held connection, spoken to directly) against a real redis-server:
the same effects and reply shapes as the client, errors raised without
leaving a reply behind for the next call, and a lost connection raised once
and connected again, as the client does."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared.keys import MESSAGE_FIELD
from shared.messages import WorkerLeft, decode_control_message
from shared.redis_lane import RedisLane
from shared.redis_streams import connect, ensure_group, read_group, xadd_message
from tests.conftest import RedisServer


async def _lane_and_client(redis_server: RedisServer) -> tuple[RedisLane, aioredis.Redis]:
    client = connect(redis_server.url)
    return RedisLane(client), client


async def _a_transaction_applies_every_queued_command_and_returns_their_replies(
    redis_server: RedisServer,
) -> None:
    lane, client = await _lane_and_client(redis_server)
    pipe = client.pipeline(transaction=True)
    pipe.set("k", b"v")
    pipe.incrby("n", 5)
    pipe.xadd("s", {MESSAGE_FIELD: b"payload"})
    pipe.hincrbyfloat("h", "busy_s", 0.25)
    replies = await lane.execute(pipe)
    assert replies[:2] == [b"OK", 5]
    assert isinstance(replies[2], bytes) and b"-" in replies[2]  # the entry's id
    assert float(replies[3]) == 0.25
    assert await client.get("k") == b"v"
    assert await client.xlen("s") == 1
    # An empty transaction is one too.
    assert await lane.execute(client.pipeline(transaction=True)) == []
    await lane.close()
    await client.aclose()


async def _a_read_has_the_clients_shape(redis_server: RedisServer) -> None:
    lane, client = await _lane_and_client(redis_server)
    for group in ("by_lane", "by_client"):
        await ensure_group(client, "s", group)
    for index in range(3):
        await client.xadd("s", {MESSAGE_FIELD: b"m%d" % index, b"other": b"x"})
    by_lane = await lane.xreadgroup("by_lane", "c", {"s": ">"}, count=2, block=10)
    by_client = await client.xreadgroup("by_client", "c", {"s": ">"}, count=2, block=10)
    assert by_lane == by_client
    assert len(by_lane[0][1]) == 2
    # Nothing new: the same empty answer after the block.
    await lane.xreadgroup("by_lane", "c", {"s": ">"}, count=10, block=10)
    assert await lane.xreadgroup("by_lane", "c", {"s": ">"}, count=10, block=10) == (
        await client.xreadgroup("by_lane", "other", {"s": ">"}, count=10, block=10)
    )
    await lane.close()
    await client.aclose()


async def _read_group_on_a_lane_decodes_and_dead_letters(redis_server: RedisServer) -> None:
    lane, client = await _lane_and_client(redis_server)
    await ensure_group(client, "control", "g")
    pipe = client.pipeline(transaction=True)
    xadd_message(pipe, "control", WorkerLeft(worker_id="w1"))
    pipe.xadd("control", {MESSAGE_FIELD: b"\xc1 not msgpack"})
    await pipe.execute()
    entries = await read_group(
        client,
        "g",
        "c",
        {"control": decode_control_message},
        "dead",
        block_ms=10,
        count=10,
        lane=lane,
    )
    assert [entry.message for entry in entries] == [WorkerLeft(worker_id="w1")]
    assert await client.xlen("dead") == 1
    await lane.close()
    await client.aclose()


async def _an_error_inside_exec_raises_and_the_next_call_is_clean(
    redis_server: RedisServer,
) -> None:
    lane, client = await _lane_and_client(redis_server)
    await client.set("text", b"abc")
    pipe = client.pipeline(transaction=True)
    pipe.set("before", b"1")
    pipe.incr("text")  # WRONGTYPE-like: not an integer, fails when EXEC runs it
    pipe.set("after", b"1")
    with pytest.raises(ResponseError, match="not an integer"):
        await lane.execute(pipe)
    # Redis ran the others (a transaction is not rolled back) ...
    assert await client.get("before") == b"1" and await client.get("after") == b"1"
    # ... and no reply of the failed call is left on the connection.
    pipe = client.pipeline(transaction=True)
    pipe.incrby("n", 2)
    assert await lane.execute(pipe) == [2]
    await lane.close()
    await client.aclose()


async def _a_command_refused_when_queued_runs_nothing(redis_server: RedisServer) -> None:
    lane, client = await _lane_and_client(redis_server)
    pipe = client.pipeline(transaction=True)
    pipe.set("k", b"v")
    pipe.execute_command("SET", "only-a-key")  # wrong number of arguments
    with pytest.raises(ResponseError, match="wrong number of arguments"):
        await lane.execute(pipe)
    assert await client.get("k") is None  # EXECABORT: nothing ran
    pipe = client.pipeline(transaction=True)
    pipe.set("k", b"v")
    assert await lane.execute(pipe) == [b"OK"]
    await lane.close()
    await client.aclose()


async def _a_killed_connection_raises_once_then_connects_again(
    redis_server: RedisServer,
) -> None:
    lane, client = await _lane_and_client(redis_server)
    await ensure_group(client, "s", "g")
    for call in ("transaction", "read"):
        pipe = client.pipeline(transaction=True)
        pipe.execute_command("CLIENT", "ID")
        [lane_client_id] = await lane.execute(pipe)
        assert await client.execute_command("CLIENT", "KILL", "ID", lane_client_id) == 1
        pipe = client.pipeline(transaction=True)
        pipe.incr("n")
        with pytest.raises(RedisConnectionError):
            if call == "transaction":
                await lane.execute(pipe)
            else:
                await lane.xreadgroup("g", "c", {"s": ">"}, count=1, block=10)
        # The failed transaction did not run; the next call connects again.
        assert await client.get("n") == (None if call == "transaction" else b"1")
        assert await lane.execute(pipe) == [1 if call == "transaction" else 2]
    await lane.close()
    await client.aclose()


async def _a_cancelled_blocking_read_leaves_nothing_behind(redis_server: RedisServer) -> None:
    lane, client = await _lane_and_client(redis_server)
    await ensure_group(client, "s", "g")
    read = asyncio.create_task(lane.xreadgroup("g", "c", {"s": ">"}, count=1, block=5000))
    await asyncio.sleep(0.2)
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    # An entry added now is not answered to the cancelled read on this
    # connection, where the next command would take it for its own reply.
    await client.xadd("s", {MESSAGE_FIELD: b"late"})
    pipe = client.pipeline(transaction=True)
    pipe.incrby("n", 7)
    assert await lane.execute(pipe) == [7]
    await lane.close()
    await client.aclose()


async def _close_gives_the_connection_back(redis_server: RedisServer) -> None:
    client = connect(redis_server.url, max_connections=1)
    lane = RedisLane(client)
    assert await lane.execute(client.pipeline(transaction=True)) == []
    # The pool's one connection is the lane's until it closes.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.ping(), 0.3)
    await lane.close()
    assert await client.ping()
    await lane.close()  # twice is harmless
    await client.aclose()


SCENARIOS = [
    _a_transaction_applies_every_queued_command_and_returns_their_replies,
    _a_read_has_the_clients_shape,
    _read_group_on_a_lane_decodes_and_dead_letters,
    _an_error_inside_exec_raises_and_the_next_call_is_clean,
    _a_command_refused_when_queued_runs_nothing,
    _a_killed_connection_raises_once_then_connects_again,
    _a_cancelled_blocking_read_leaves_nothing_behind,
    _close_gives_the_connection_back,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda scenario: scenario.__name__[1:])
def test_lane(redis_server: RedisServer, scenario) -> None:
    asyncio.run(scenario(redis_server))
