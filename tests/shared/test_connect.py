"""``connect``'s client against a real redis-server: a lost connection raises
once, to the caller, and the next call connects again (nothing is retried
behind the caller's back, so no transaction can run twice)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.redis_streams import connect
from tests.conftest import RedisServer


async def _a_killed_connection_raises_once(url: str) -> None:
    client = connect(url, max_connections=1)
    killer = aioredis.Redis.from_url(url)
    own_id = await client.execute_command("CLIENT", "ID")
    # Killed while a command is on it (a blocking pop): killed between commands, the
    # pool may notice the closed socket first and connect again before sending, a
    # race this test once lost.
    popping = asyncio.create_task(client.blpop(["jobs"], timeout=10))
    while int((await killer.info("clients"))["blocked_clients"]) == 0:
        await asyncio.sleep(0.01)
    assert await killer.execute_command("CLIENT", "KILL", "ID", own_id) == 1
    with pytest.raises(RedisConnectionError):
        await popping
    await killer.rpush("jobs", "job")
    await asyncio.sleep(0.2)
    assert await killer.llen("jobs") == 1  # the pop was not sent again behind the caller
    assert await client.incr("n") == 1  # the next call connects again
    await client.aclose()
    await killer.aclose()


def test_a_killed_connection_raises_once_and_is_not_retried(redis_server: RedisServer) -> None:
    asyncio.run(_a_killed_connection_raises_once(redis_server.url))
