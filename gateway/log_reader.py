"""The gateway's reader of request logs and of the step journal
(``shared/request_log.py``): the I/O behind a ``resume`` of a request this
gateway does not know, behind following such a request to its end (its log
for how it ends, the journal for its tokens, in one blocking XREAD), and
behind refilling what pub/sub lost while Redis was unreachable. What the
entries mean is the session's business; this only reads them and hands them
over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, cast

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gateway.actions import Action, FollowLog, LoadLog, SendFrame
from gateway.session import GatewaySession
from shared.heartbeat import sleep_unless_set
from shared.keys import RedisKeys
from shared.messages import SampledToken, TokenBatch
from shared.protocol import Error
from shared.redis_streams import reconnect_backoff_s
from shared.request_log import (
    RawEntries,
    decode_entries,
    decode_journal,
    read_request_log,
    read_request_logs,
)

logger = structlog.get_logger(__name__)

# Longest a follow XREAD (or the wait for a first log to follow) blocks: how
# late a new log to follow, or the stop, may be noticed.
FOLLOW_BLOCK_MS = 500
# What a client is told when Redis did not answer (its error is only logged).
UNREADABLE_LOG_MESSAGE = "could not read the request's log, retry later"


class LogReader:
    """Reads request logs for one gateway; ``follow_until`` runs as an owned task."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        session: GatewaySession,
        apply: Callable[[list[Action]], Awaitable[None]],
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._session = session
        self._apply = apply
        # Requests followed: request id -> id of the last log entry read.
        self._followed: dict[str, bytes] = {}
        # The last journal entry read for them (None: nothing followed yet).
        self._journal_id: bytes | None = None
        self._wakeup = asyncio.Event()

    def follow(self, action: FollowLog) -> None:
        """Start following one request's log and its tokens in the journal
        (picked up by ``follow_until``). The journal is read again from the
        oldest point any followed request still needs: the others skip tokens
        they have."""
        self._followed[action.request_id] = action.after_entry_id
        if self._journal_id is None or _stream_id(action.after_journal_id) < _stream_id(
            self._journal_id
        ):
            self._journal_id = action.after_journal_id
        self._wakeup.set()

    async def load(self, action: LoadLog) -> None:
        """Read one whole log for a ``resume`` and hand it to the session."""
        try:
            log = await read_request_log(self._redis, self._keys, action.request_id)
        except (RedisError, OSError) as error:
            logger.warning("request_log_unreadable", request_id=action.request_id, error=str(error))
            frame = Error(code="internal", message=UNREADABLE_LOG_MESSAGE, id=action.resume.id)
            await self._apply([SendFrame(action.socket_id, frame)])
            return
        await self._apply(self._session.on_log_loaded(action.socket_id, action.resume, log))

    async def follow_until(self, stop: asyncio.Event) -> None:
        """Feed the session the entries of every followed log as they come (one
        blocking XREAD for all of them) until ``stop``; a request leaves the set
        once the session has finished it."""
        failures = 0
        while not stop.is_set():
            unfinished = set(self._session.unfinished_request_ids())
            self._followed = {
                request_id: entry_id
                for request_id, entry_id in self._followed.items()
                if request_id in unfinished
            }
            if not self._followed:
                self._journal_id = None
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), FOLLOW_BLOCK_MS / 1000)
                continue
            try:
                reply = await self._read_followed()
            except (RedisError, OSError) as error:
                logger.warning("followed_logs_unreadable", error=str(error))
                await sleep_unless_set(stop, reconnect_backoff_s(failures))
                failures += 1
                continue
            failures = 0
            for raw_stream, raw_entries in reply:
                log_key = raw_stream.decode()
                if log_key == self._keys.results:
                    await self._apply_journal(raw_entries)
                    continue
                request_id = log_key.removeprefix(self._keys.request_log(""))
                if request_id in self._followed and raw_entries:
                    self._followed[request_id] = raw_entries[-1][0]
                decoded = [entry for _, entry in decode_entries(raw_entries, log_key)]
                await self._apply(self._session.on_log_entries(request_id, decoded, log_key))

    async def catch_up(self, stop: asyncio.Event) -> None:
        """Read again the log of every request running here, for what pub/sub
        lost while Redis was unreachable (tried again until Redis answers)."""
        pending = self._session.unfinished_request_ids()
        failures = 0
        while pending and not stop.is_set():
            try:
                logs = await read_request_logs(self._redis, self._keys, pending)
            except (RedisError, OSError) as error:
                logger.warning("logs_catch_up_failed", num_requests=len(pending), error=str(error))
                await sleep_unless_set(stop, reconnect_backoff_s(failures))
                failures += 1
                continue
            for request_id, log in zip(pending, logs, strict=True):
                if log is not None:
                    source = self._keys.request_log(request_id)
                    await self._apply(
                        self._session.on_log_entries(request_id, log.as_entries(), source)
                    )
            return

    async def _apply_journal(self, raw_entries: RawEntries) -> None:
        """The followed requests' tokens in new journal entries, one batch per request."""
        if raw_entries:
            self._journal_id = raw_entries[-1][0]
        source = self._keys.results
        for _, output in decode_journal(raw_entries, source):
            tokens: dict[str, list[SampledToken]] = {}
            for token in output.tokens:
                if token.request_id in self._followed:
                    tokens.setdefault(token.request_id, []).append(token)
            for request_id, batch in tokens.items():
                entries = [TokenBatch(worker_id=output.worker_id, tokens=batch)]
                await self._apply(self._session.on_log_entries(request_id, entries, source))

    async def _read_followed(self) -> list[tuple[bytes, RawEntries]]:
        streams = {
            self._keys.request_log(request_id): entry_id
            for request_id, entry_id in self._followed.items()
        }
        if self._journal_id is not None:
            streams[self._keys.results] = self._journal_id
        reply = await self._redis.xread(cast(Any, streams), block=FOLLOW_BLOCK_MS, count=256)
        return cast(list[tuple[bytes, RawEntries]], reply or [])


def _stream_id(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id ``<ms>-<seq>`` as a pair that orders like Redis orders them."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
