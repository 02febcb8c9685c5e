"""One pooled connection held by one task for its per-step commands.

redis-py's client sends each command through layers that cost more of the
caller's CPU than the command itself on a small machine: a pool checkout and
release, the retry wrapper, command-name lookups, per-command response
callbacks and the observability hooks. Measured on the 2-vCPU EPYC the CPU
benchmarks run on (client CPU per call, Redis on the same CPU), a stream read
of one entry costs 245–263 µs through the client and 139–143 µs on the
connection; a MULTI/EXEC of four commands 356–384 µs against 168–173 µs.

The actors' turn loops make such calls once per step — the scheduler's read
of results and its turn's transaction, the worker's plan read and its step's
transaction — so each of those tasks holds a lane: one connection of the
client's own pool, spoken to directly with redis-py's packing and reply
parser. Nothing else about the call changes:

- the transaction is the queued ``Pipeline``'s commands in MULTI/EXEC, built
  by the same helpers as before; an error reply to any of them raises, as
  ``Pipeline.execute`` does, after every reply has been read;
- a connection or timeout error raises to the caller, as the client's does
  (the actors' loops back off and go on), and the connection is dropped:
  redis-py's send and read drop it on any exception, a cancel too, so a
  half-read reply never reaches the next command, which connects again;
- replies are what Redis sent, except the stream read's, which goes through
  redis-py's XREADGROUP callback so its shape is the client's.

A lane serves one task at a time; a task that needs a second concurrent call
takes a second lane (the worker has one for reading plans, one for publishing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import AbstractConnection
from redis.client import EMPTY_RESPONSE
from redis.exceptions import ResponseError


class RedisLane:
    """A connection of ``redis``'s pool, taken on first use and held until ``close``."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._connection: AbstractConnection | None = None

    async def xreadgroup(
        self,
        group: str,
        consumer: str,
        streams: Mapping[str, str],
        *,
        count: int,
        block: int,
    ) -> Any:
        """XREADGROUP, parsed as ``redis.xreadgroup`` parses it."""
        args: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count, "BLOCK", block]
        args += ["STREAMS", *streams, *streams.values()]
        connection = await self._take()
        packed = connection.pack_command(*args)
        reply = await self._exchange(connection, packed, 1)
        return self._redis.response_callbacks["XREADGROUP"](reply[0])

    async def execute(self, pipe: Pipeline) -> list[Any]:
        """Every command queued on ``pipe``, in one MULTI/EXEC; their replies, in order."""
        commands = pipe.command_stack
        sent = [args for args, options in commands if EMPTY_RESPONSE not in options]
        connection = await self._take()
        packed = connection.pack_commands([("MULTI",), *sent, ("EXEC",)])
        replies = await self._exchange(connection, packed, len(sent) + 2)
        queued, result = replies[1:-1], replies[-1]
        for reply in (replies[0], *queued):
            if isinstance(reply, ResponseError):
                raise reply  # refused as it was queued: EXEC ran nothing
        if isinstance(result, ResponseError):
            raise result
        if not isinstance(result, list) or len(result) != len(sent):
            await connection.disconnect()
            raise ResponseError(f"EXEC answered {result!r} for {len(sent)} commands")
        replies_by_command = iter(result)
        answers = [
            options[EMPTY_RESPONSE] if EMPTY_RESPONSE in options else next(replies_by_command)
            for _, options in commands
        ]
        for answer in answers:
            if isinstance(answer, ResponseError):
                raise answer
        return answers

    async def close(self) -> None:
        """Give the connection back to the pool (a later call takes one again)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await self._redis.connection_pool.release(connection)

    async def _take(self) -> AbstractConnection:
        if self._connection is None:
            self._connection = await self._redis.connection_pool.get_connection()
        return self._connection

    @staticmethod
    async def _exchange(
        connection: AbstractConnection, packed: Sequence[bytes], num_replies: int
    ) -> list[Any]:
        """Send ``packed`` and read ``num_replies`` replies; an error reply is
        returned in its place, not raised, so every reply is read."""
        await connection.send_packed_command(packed)
        replies: list[Any] = []
        for _ in range(num_replies):
            try:
                replies.append(await connection.read_response())
            except ResponseError as error:  # ExecAbortError too: EXEC refused
                replies.append(error)
        return replies
