"""Each request's durable record: its log, plus the step journal.

A request's tokens are written once, in the step that sampled them: the
worker's ``StepOutput`` of that step (one entry of the ``results`` stream,
the **journal**) carries every token of the step, in the same transaction
that publishes them to the gateways. The journal is at once the scheduler's
input and the durable record of every token sent. Each request's own log
(one Redis stream per request) holds the rest:

- the gateway writes the first entry (a ``RequestRecord``) in the same
  transaction that submits the request;
- the scheduler writes the request's tokens into its log as a *checkpoint*
  (one ``TokenBatch`` of every token since the last one) when the request
  ends, in the same transaction that acknowledges its submit, and while it
  runs whenever its oldest token not yet in the log would otherwise keep
  the journal from being trimmed (``scheduler_actor/journal_retention.py``);
- a gateway that ends a request itself (cancel, closed socket, stop string)
  appends a ``RequestEnded``; a worker or the scheduler that ends it with an
  error appends a ``RequestFailed``.

So a request's tokens are its log's checkpoints plus the journal entries not
yet checkpointed, and ``read_request_logs`` folds both. The journal keeps
every entry that holds a token not yet in its request's log (the scheduler
trims it by MINID to the oldest such entry), so nothing is missed, and a
token found twice (a checkpoint and the journal, or a recompute) counts once
(by its index). From a request's record alone:

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
    StepOutput,
    TokenBatch,
    decode_log_entry,
    decode_step_output,
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
    # The id of the last journal entry read for it: where following the journal resumes.
    journal_entry_id: bytes = b"0-0"
    # The log's first entry (the record) was written at this Redis time (ms):
    # no token of the request is older in the journal.
    submitted_ms: int = 0

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.record.submit.request_id

    @property
    def wants_tokens(self) -> bool:
        """Whether tokens may be missing: neither finished by a token nor at its limit."""
        return self.finish_reason is None and len(self.token_ids) < self.token_limit

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

    @property
    def token_limit(self) -> int:
        """How many tokens the request can have: its ``max_tokens``, or as many
        as its client got when its gateway ended it."""
        limit = self.record.submit.sampling.max_tokens
        return limit if self.ended_after is None else min(limit, self.ended_after)

    def fold(self, entry_id: bytes, entry: RequestLogEntry) -> None:
        """Take one more entry of the log, in log order."""
        self.last_entry_id = entry_id
        if isinstance(entry, RequestFailed):
            # The first end wins: a failure after the last token changes nothing.
            if not self.is_finished:
                self.failure = entry
            return
        if isinstance(entry, RequestEnded):
            if self.ended_after is None and self.finish_reason is None:
                # The client saw exactly these; later ones reached no one.
                self.ended_after = entry.num_tokens
                if len(self.token_ids) > entry.num_tokens:
                    del self.token_ids[entry.num_tokens :]
            return
        if isinstance(entry, TokenBatch):
            self.fold_tokens(entry.tokens)

    def fold_tokens(self, tokens: Sequence[SampledToken]) -> None:
        """Take tokens from a checkpoint or a journal entry, in any order of
        sources: each index once, none past the last (an end recorded before
        its tokens were checkpointed still lets them in)."""
        for token in tokens:
            if self.finish_reason is not None:
                return
            # A recompute may send an index again (the same token): keep the first.
            if (
                token.request_id == self.request_id
                and token.index == len(self.token_ids)
                and len(self.token_ids) < self.token_limit
            ):
                self.token_ids.append(token.token_id)
                if token.finish_reason is not None:
                    self.finish_reason = token.finish_reason


def queue_record(pipe: Pipeline, keys: RedisKeys, record: RequestRecord) -> None:
    """Start a request's log (on ``pipe``, meant to be a transaction with the submit)."""
    log_key = keys.request_log(record.submit.request_id)
    pipe.xadd(log_key, {MESSAGE_FIELD: encode(record)})
    pipe.expire(log_key, LIVE_TTL_S)


def queue_checkpoint(
    pipe: Pipeline,
    keys: RedisKeys,
    tokens: Sequence[SampledToken],
    retention_s: int | None,
) -> None:
    """Append a request's tokens (one ``TokenBatch``: those since its last
    checkpoint, the last one with its finish reason if it finished) to its log;
    with ``retention_s`` the request has ended and its log goes after that long.
    A log that is gone (expired, or a request no gateway logged) is not created
    again."""
    if not tokens:
        return
    log_key = keys.request_log(tokens[0].request_id)
    batch = TokenBatch(worker_id="", tokens=list(tokens))
    pipe.xadd(log_key, {MESSAGE_FIELD: encode(batch)}, nomkstream=True)
    if retention_s is not None:
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
    """The whole record of ``request_id`` folded (its log and its tokens still
    only in the journal), or None when it has no log (never logged, expired,
    or its first entry is not a record)."""
    [log] = await read_request_logs(redis, keys, [request_id])
    return log


async def read_request_logs(
    redis: aioredis.Redis, keys: RedisKeys, request_ids: Sequence[str], batch_size: int = 256
) -> list[RequestLog | None]:
    """``read_request_log`` of many requests: their logs, ``batch_size`` per
    round trip, then one pass over the journal for all of them, then what their
    logs got meanwhile (the scheduler trims the journal only after it wrote
    the trimmed tokens into the logs, so a token the pass missed is there)."""
    logs = await _read_logs(redis, keys, request_ids, batch_size)
    found = [log for log in logs if log is not None]
    await fold_journal(redis, keys, found)
    still_missing = [log for log in found if log.wants_tokens]
    again = await _read_logs(redis, keys, [log.request_id for log in still_missing], batch_size)
    for log, newer in zip(still_missing, again, strict=True):
        if newer is not None:
            log.fold_tokens(newer.sampled_tokens())
    return logs


async def _read_logs(
    redis: aioredis.Redis, keys: RedisKeys, request_ids: Sequence[str], batch_size: int
) -> list[RequestLog | None]:
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


async def fold_journal(
    redis: aioredis.Redis, keys: RedisKeys, logs: Sequence[RequestLog], page: int = 512
) -> None:
    """Fold into ``logs`` their tokens that are only in the journal: every
    entry from the oldest unfinished one's submit to the journal's end, read
    ``page`` entries per round trip. Each log's ``journal_entry_id`` becomes
    the last entry read, where following the journal goes on."""
    journal = keys.results
    newest = cast(RawEntries, await redis.xrevrange(journal, count=1))
    end_id = newest[0][0] if newest else b"0-0"
    for log in logs:
        log.journal_entry_id = end_id
    unfinished = {log.request_id: log for log in logs if log.wants_tokens}
    if not unfinished or not newest:
        return
    cursor = min(log.submitted_ms for log in unfinished.values())
    next_id: bytes | str = f"{cursor}-0"
    while True:
        raw_entries = cast(RawEntries, await redis.xrange(journal, next_id, end_id, count=page))
        fold_journal_entries(unfinished, raw_entries, journal)
        if len(raw_entries) < page:
            return
        next_id = b"(" + raw_entries[-1][0]


def fold_journal_entries(logs: dict[str, RequestLog], raw_entries: RawEntries, source: str) -> None:
    """Fold the tokens of journal entries (``StepOutput``s) into the logs they
    name, by request id; an entry that does not decode is logged and skipped."""
    for _, output in decode_journal(raw_entries, source):
        for token in output.tokens:
            log = logs.get(token.request_id)
            if log is not None:
                log.fold_tokens((token,))


def decode_journal(raw_entries: RawEntries, source: str) -> list[tuple[bytes, StepOutput]]:
    """Decode raw journal entries; one that does not decode is logged and skipped
    (the scheduler dead-letters it when it reads it first)."""
    decoded: list[tuple[bytes, StepOutput]] = []
    for entry_id, fields in raw_entries:
        try:
            data = (fields or {}).get(MESSAGE_FIELD.encode())
            if data is None:
                raise ValueError(f"entry has no {MESSAGE_FIELD!r} field")
            decoded.append((entry_id, decode_step_output(data)))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            _log.warning("undecodable_journal_entry", source=source, error=str(error))
    return decoded


def _fold_log(raw_entries: RawEntries, source: str) -> RequestLog | None:
    log: RequestLog | None = None
    for entry_id, entry in decode_entries(raw_entries, source):
        if log is None:
            if not isinstance(entry, RequestRecord):
                return None
            log = RequestLog(record=entry, last_entry_id=entry_id, submitted_ms=_entry_ms(entry_id))
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


def _entry_ms(entry_id: bytes) -> int:
    """The Redis time (ms) in a stream entry id ``<ms>-<seq>``."""
    return int(entry_id.split(b"-", 1)[0])
