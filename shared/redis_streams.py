"""Redis streams behind a tiny generic transport: connect, consumer groups,
read-and-decode with dead-lettering, ack, and XADD of a wire Struct.

Both the scheduler and the workers speak to Redis through these helpers, so
neither sees raw stream replies. An entry that does not decode never reaches
the caller: it goes to the dead stream with where it came from and why, is
acknowledged, and reading goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from shared.keys import MESSAGE_FIELD
from shared.messages import encode
from shared.redis_lane import RedisLane

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# How long a command waits for a free pooled connection before it fails.
POOL_WAIT_S = 30.0
# Waits between tries while Redis does not answer (the last one repeats).
RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
# Every stream is bounded (the embedded Redis has a maxmemory, and with
# ``noeviction`` a full Redis refuses writes). Trimming is approximate (MAXLEN ~):
# Redis then drops whole nodes, which costs nothing.
# The dead stream only helps a human debug; keep its most recent entries.
DEAD_STREAM_MAXLEN = 10_000
# Control and results entries are read within a turn (100 ms) and deleted once
# applied; the cap only bounds what piles up while the scheduler is down.
CONTROL_STREAM_MAXLEN = 100_000
RESULTS_STREAM_MAXLEN = 100_000
# Plans are read within a step of being sent (at most max_inflight are unread),
# so keeping about this many bounds the stream without ever losing one.
PLAN_STREAM_MAXLEN = 1000
# The requests stream is never trimmed: a submit stays pending in the
# scheduler's group until its request ends (that is how a new scheduler
# recovers it), so trimming could drop live work. It is bounded instead by
# admission: the scheduler refuses a submit beyond ``max_waiting`` waiting
# requests, and acks and XDELs every submit it refuses and every one whose
# request ended, so the stream holds at most max_waiting + the running
# requests (+ the submits of one unread turn).

_log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StreamEntry(Generic[T_co]):
    """One decoded entry of a stream read through a consumer group."""

    stream: str
    entry_id: bytes
    message: T_co


def connect(
    url: str, *, max_connections: int = 64, socket_timeout_s: float | None = None
) -> aioredis.Redis:
    """A client whose calls are never retried behind the caller's back.

    A lost connection raises (``ConnectionError``; the connection is dropped
    and the next call connects again) and the caller's loop backs off
    (``reconnect_backoff_s``) and goes on: a transaction retried by the
    client after its reply was lost would run twice.

    Its pool blocks (up to ``POOL_WAIT_S``) when all ``max_connections`` are in
    use, instead of failing: a burst of commands (a thousand clients sending
    at once) waits its turn rather than turning into errors. Replies stay
    bytes: every payload is MessagePack.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=POOL_WAIT_S,
        decode_responses=False,
        retry=Retry(NoBackoff(), retries=0),
        health_check_interval=30,
        socket_connect_timeout=socket_timeout_s,
        socket_timeout=socket_timeout_s,
    )
    return aioredis.Redis.from_pool(pool)


async def ensure_group(redis: aioredis.Redis, stream: str, group: str, start_id: str = "0") -> bool:
    """Create ``group`` on ``stream`` (and the stream) if missing; True if it was created.

    ``start_id`` only applies to a new group: "0" delivers what the stream
    already holds, "$" only what is added from now on.
    """
    try:
        await redis.xgroup_create(stream, group, id=start_id, mkstream=True)
    except ResponseError as error:
        if "BUSYGROUP" not in str(error):
            raise
        return False
    return True


async def position_group_at_end(redis: aioredis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` if missing and move it to the stream's end,
    so that nothing already in the stream is ever delivered to it."""
    if not await ensure_group(redis, stream, group, start_id="$"):
        await redis.xgroup_setid(stream, group, id="$")


async def read_group(
    redis: aioredis.Redis,
    group: str,
    consumer: str,
    decoders: Mapping[str, Callable[[bytes], T]],
    dead_stream: str,
    *,
    block_ms: int,
    count: int,
    lane: RedisLane | None = None,
) -> list[StreamEntry[T]]:
    """New entries of every stream in ``decoders`` (in that order), each
    decoded by its stream's decoder; undecodable ones are dead-lettered and
    acknowledged, never returned. Waits at most ``block_ms`` for the first.
    A turn loop reads on its ``lane`` (``shared/redis_lane.py``)."""
    reader = redis if lane is None else lane
    reply = await reader.xreadgroup(
        group, consumer, dict.fromkeys(decoders, ">"), count=count, block=block_ms
    )
    if not reply:
        return []
    by_stream: dict[str, list[tuple[bytes, dict[bytes, bytes]]]] = {}
    for raw_stream, raw_entries in _stream_items(reply):
        stream = raw_stream.decode() if isinstance(raw_stream, bytes) else str(raw_stream)
        by_stream[stream] = raw_entries
    entries: list[StreamEntry[T]] = []
    for stream, decode in decoders.items():
        entries += await _decode_entries(
            redis, group, stream, decode, dead_stream, by_stream.get(stream, [])
        )
    return entries


async def read_pending(
    redis: aioredis.Redis,
    group: str,
    consumer: str,
    stream: str,
    decode: Callable[[bytes], T],
    dead_stream: str,
    *,
    count: int = 1000,
) -> list[StreamEntry[T]]:
    """Every entry of ``stream`` delivered to ``consumer`` and not yet
    acknowledged (what an earlier incarnation was still working on), oldest
    first; undecodable ones are dead-lettered and acknowledged."""
    entries: list[StreamEntry[T]] = []
    after_id = b"0"
    while True:
        reply = await redis.xreadgroup(group, consumer, {stream: after_id}, count=count)
        raw_entries = [entry for _, page in _stream_items(reply) for entry in page]
        if not raw_entries:
            return entries
        after_id = raw_entries[-1][0]
        entries += await _decode_entries(redis, group, stream, decode, dead_stream, raw_entries)


async def _decode_entries(
    redis: aioredis.Redis,
    group: str,
    stream: str,
    decode: Callable[[bytes], T],
    dead_stream: str,
    raw_entries: list[tuple[bytes, dict[bytes, bytes]]],
) -> list[StreamEntry[T]]:
    entries: list[StreamEntry[T]] = []
    for entry_id, fields in raw_entries:
        # A pending entry deleted meanwhile comes back without fields.
        data = (fields or {}).get(MESSAGE_FIELD.encode())
        try:
            if data is None:
                raise ValueError(f"entry has no {MESSAGE_FIELD!r} field")
            message = decode(data)
        # RecursionError: msgspec's answer to a map nested thousands deep.
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError) as error:
            await dead_letter(redis, dead_stream, stream, str(error), data or b"")
            await redis.xack(stream, group, entry_id)
            _log.warning(
                "undecodable_entry", stream=stream, entry_id=entry_id.decode(), error=str(error)
            )
            continue
        entries.append(StreamEntry(stream, entry_id, message))
    return entries


def _stream_items(reply: Any) -> list[tuple[Any, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREADGROUP's RESP2 reply (``connect`` speaks RESP2) as (stream, entries) pairs."""
    return [(stream, entries) for stream, entries in reply]


async def dead_letter(
    redis: aioredis.Redis, dead_stream: str, source: str, error: str, data: bytes
) -> None:
    """Keep a message nobody could handle, with its source stream and the reason."""
    pipe = redis.pipeline(transaction=False)
    queue_dead_letter(pipe, dead_stream, source, error, data)
    await pipe.execute()


def queue_dead_letter(
    pipe: Pipeline, dead_stream: str, source: str, error: str, data: bytes
) -> None:
    """Queue on ``pipe`` the XADD that keeps an unhandled message in the dead stream."""
    pipe.xadd(
        dead_stream,
        {"source": source, "error": error, "data": data},
        maxlen=DEAD_STREAM_MAXLEN,
        approximate=True,
    )


def xadd_message(
    pipe: Pipeline, stream: str, message: msgspec.Struct, maxlen: int | None = None
) -> None:
    """Queue an XADD of one wire Struct on ``pipe`` (trimmed to about ``maxlen``)."""
    pipe.xadd(stream, {MESSAGE_FIELD: encode(message)}, maxlen=maxlen, approximate=True)


async def send_message(
    redis: aioredis.Redis, stream: str, message: msgspec.Struct, maxlen: int | None = None
) -> bytes:
    """XADD one wire Struct now; returns its entry id."""
    entry_id = await redis.xadd(
        stream, {MESSAGE_FIELD: encode(message)}, maxlen=maxlen, approximate=True
    )
    return entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()


def reconnect_backoff_s(failures: int) -> float:
    """How long to wait before the next try after ``failures`` failed ones in a row."""
    return RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
