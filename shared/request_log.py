"""Each request's durable log: one Redis stream per request.

The gateway writes the first entry (a ``RequestRecord``) in the same
transaction that submits the request; each worker appends the tokens it
sends (a ``TokenBatch`` per request per step) in the same transaction that
publishes them to the gateway and reports the step to the scheduler, so the
log holds exactly the tokens some client may have seen; a gateway that ends
a request itself (cancel, closed socket, stop string) appends a
``RequestEnded``; a worker or the scheduler that ends it with an error (a
request that failed in a step, was on two lost workers, or was refused)
appends a ``RequestFailed``. From the log alone:

- a gateway serves ``resume`` of a request another (dead) gateway accepted;
- a gateway fills the gap pub/sub left while it was cut off from Redis;
- a new scheduler recovers the tokens already sent, so it recomputes from
  prompt + those tokens and the client sees each token once.

The log lives ``LIVE_TTL_S`` while its request runs and ``retention_s``
(``RedisSettings.log_retention_s``) once it ended, then Redis drops it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import msgspec
import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline

from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import (
    FinishReason,
    RequestEnded,
    RequestFailed,
    RequestLogEntry,
    RequestRecord,
    SampledToken,
    TokenBatch,
    decode_log_entry,
    encode,
)

# Long enough for any request to wait and run; a log whose request vanished goes eventually.
LIVE_TTL_S = 24 * 3600

# XRANGE / XREAD entries as redis-py returns them (bytes: replies are not decoded).
RawEntries = list[tuple[bytes, dict[bytes, bytes]]]

_log = structlog.get_logger(__name__)


@dataclass
class RequestLog:
    """A request's log folded: its record, its tokens in order (each index once)
    and, when it has ended, how."""

    record: RequestRecord
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # The gateway ended it after this many tokens (RequestEnded).
    ended_after: int | None = None
    # The service ended it with this error (RequestFailed).
    failure: RequestFailed | None = None
    # The id of the last entry folded in: where following the log resumes.
    last_entry_id: bytes = b"0"

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.record.submit.request_id

    @property
    def is_finished(self) -> bool:
        """Whether no more tokens will be sent for it."""
        return (
            self.finish_reason is not None
            or self.ended_after is not None
            or self.failure is not None
            or len(self.token_ids) >= self.record.submit.sampling.max_tokens
        )

    def sampled_tokens(self) -> list[SampledToken]:
        """Its tokens as the worker sent them (the last one with its finish reason)."""
        tokens = [
            SampledToken(request_id=self.request_id, token_id=token_id, index=index)
            for index, token_id in enumerate(self.token_ids)
        ]
        if tokens and self.finish_reason is not None:
            tokens[-1] = msgspec.structs.replace(tokens[-1], finish_reason=self.finish_reason)
        return tokens

    def as_entries(self) -> list[TokenBatch | RequestEnded | RequestFailed]:
        """The folded log as entries again: its tokens, then its end if it has one."""
        entries: list[TokenBatch | RequestEnded | RequestFailed] = [
            TokenBatch(worker_id="", tokens=self.sampled_tokens())
        ]
        if self.ended_after is not None:
            entries.append(RequestEnded(request_id=self.request_id, num_tokens=self.ended_after))
        if self.failure is not None:
            entries.append(self.failure)
        return entries

    def fold(self, entry_id: bytes, entry: RequestLogEntry) -> None:
        """Take one more entry of the log, in log order."""
        self.last_entry_id = entry_id
        if isinstance(entry, RequestFailed):
            # The first end wins: a failure after the last token changes nothing.
            if not self.is_finished:
                self.failure = entry
            return
        if isinstance(entry, RequestEnded):
            if self.ended_after is None and entry.num_tokens < len(self.token_ids):
                # The client saw only these; later ones reached no one.
                del self.token_ids[entry.num_tokens :]
                self.finish_reason = None
            if self.ended_after is None and self.finish_reason is None:
                self.ended_after = len(self.token_ids)
            return
        if not isinstance(entry, TokenBatch) or self.is_finished:
            return
        for token in entry.tokens:
            # A recompute may send an index again (the same token): keep the first.
            if token.request_id == self.request_id and token.index == len(self.token_ids):
                self.token_ids.append(token.token_id)
                if token.finish_reason is not None:
                    self.finish_reason = token.finish_reason
                    return


def queue_record(pipe: Pipeline, keys: RedisKeys, record: RequestRecord) -> None:
    """Start a request's log (on ``pipe``, meant to be a transaction with the submit)."""
    log_key = keys.request_log(record.submit.request_id)
    pipe.xadd(log_key, {MESSAGE_FIELD: encode(record)})
    pipe.expire(log_key, LIVE_TTL_S)


def queue_tokens(
    pipe: Pipeline, keys: RedisKeys, worker_id: str, token: SampledToken, retention_s: int
) -> None:
    """Append one sent token to its request's log; the log of a finished request
    is kept ``retention_s`` from its last token. A log that is gone (expired, or
    a request no gateway logged) is not created again."""
    log_key = keys.request_log(token.request_id)
    batch = TokenBatch(worker_id=worker_id, tokens=[token])
    pipe.xadd(log_key, {MESSAGE_FIELD: encode(batch)}, nomkstream=True)
    if token.finish_reason is not None:
        pipe.expire(log_key, retention_s)


def queue_end(pipe: Pipeline, keys: RedisKeys, ended: RequestEnded, retention_s: int) -> None:
    """Record that a gateway ended the request itself; the log goes after ``retention_s``."""
    log_key = keys.request_log(ended.request_id)
    pipe.xadd(log_key, {MESSAGE_FIELD: encode(ended)}, nomkstream=True)
    pipe.expire(log_key, retention_s)


def queue_failure(pipe: Pipeline, keys: RedisKeys, failed: RequestFailed, retention_s: int) -> None:
    """Record that the service ended the request with an error; its log goes
    after ``retention_s`` (not the running TTL: nothing more will be written)."""
    log_key = keys.request_log(failed.request_id)
    pipe.xadd(log_key, {MESSAGE_FIELD: encode(failed)}, nomkstream=True)
    pipe.expire(log_key, retention_s)


async def read_request_log(
    redis: aioredis.Redis, keys: RedisKeys, request_id: str
) -> RequestLog | None:
    """The whole log of ``request_id`` folded, or None when there is none (never
    logged, expired, or its first entry is not a record)."""
    [log] = await read_request_logs(redis, keys, [request_id])
    return log


async def read_request_logs(
    redis: aioredis.Redis, keys: RedisKeys, request_ids: Sequence[str], batch_size: int = 256
) -> list[RequestLog | None]:
    """``read_request_log`` of many requests, ``batch_size`` per round trip."""
    logs: list[RequestLog | None] = []
    for start in range(0, len(request_ids), batch_size):
        batch = request_ids[start : start + batch_size]
        pipe = redis.pipeline(transaction=False)
        for request_id in batch:
            pipe.xrange(keys.request_log(request_id))
        replies = await pipe.execute()
        for request_id, raw_entries in zip(batch, replies, strict=True):
            logs.append(_fold_log(cast(RawEntries, raw_entries), keys.request_log(request_id)))
    return logs


def _fold_log(raw_entries: RawEntries, source: str) -> RequestLog | None:
    log: RequestLog | None = None
    for entry_id, entry in decode_entries(raw_entries, source):
        if log is None:
            if not isinstance(entry, RequestRecord):
                return None
            log = RequestLog(record=entry, last_entry_id=entry_id)
        else:
            log.fold(entry_id, entry)
    return log


def decode_entries(raw_entries: RawEntries, source: str) -> list[tuple[bytes, RequestLogEntry]]:
    """Decode raw log entries; one that does not decode is logged and skipped
    (a log is read again and again, so it is not moved to the dead stream)."""
    decoded: list[tuple[bytes, RequestLogEntry]] = []
    for entry_id, fields in raw_entries:
        try:
            data = (fields or {}).get(MESSAGE_FIELD.encode())
            if data is None:
                raise ValueError(f"entry has no {MESSAGE_FIELD!r} field")
            decoded.append((entry_id, decode_log_entry(data)))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            _log.warning("undecodable_log_entry", source=source, error=str(error))
    return decoded
