"""The gateway's writer to Redis: ``PostUpstream`` (a submit with its log
record, a cancel with its log end, an adoption), the tenant's tokens-per-minute
reservation before a submit, and dead letters.

What Redis answers is turned into what a client may be told: a refused write
(out of memory under ``maxmemory noeviction``) is ``queue_full``, anything
else ``internal``, and neither carries Redis's text, which is only logged.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.actions import Action, DeadLetter, PostUpstream
from gateway.session import GatewaySession
from gateway.tenants import TOKENS_WINDOW_S, TokenReservation, over_tokens_per_minute, tokens_window
from shared.keys import RedisKeys
from shared.messages import RequestRecord, SubmitRequest
from shared.protocol import ErrorCode
from shared.redis_streams import dead_letter, reconnect_backoff_s, xadd_message
from shared.request_log import queue_end, queue_record

logger = structlog.get_logger(__name__)

OVERLOADED_MESSAGE = "service overloaded, retry later"
UNAVAILABLE_MESSAGE = "could not queue the request, retry later"
# How long a post cut off by a lost connection is tried again (a Redis restart).
POST_RETRY_S = 10.0


def client_refusal(error: Exception) -> tuple[ErrorCode, str]:
    """What a client is told when Redis did not take its request's write."""
    # redis-py names the OOM reply by its class (and drops the "OOM" prefix);
    # the prefix is checked too for a reply it does not know as such.
    if isinstance(error, OutOfMemoryError) or (
        isinstance(error, ResponseError) and str(error).startswith("OOM")
    ):
        return "queue_full", OVERLOADED_MESSAGE
    return "internal", UNAVAILABLE_MESSAGE


class UpstreamWriter:
    """Writes for one gateway; each call returns the session's follow-up actions."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        session: GatewaySession,
        log_retention_s: int,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._session = session
        self._log_retention_s = log_retention_s

    async def post(self, action: PostUpstream) -> list[Action]:
        """XADD the message (with its log entry, in one transaction); a submit
        first reserves its tokens. Returns the actions that end a submit that
        did not go through."""
        message = action.message
        is_submit = isinstance(message, SubmitRequest)
        if action.reservation is not None and is_submit:
            refusal = await self._reserve_tokens(action.reservation, message.request_id)
            if refusal:
                return refusal
        stream = self._keys.requests if is_submit else self._keys.control
        try:
            await self._post_until_known(action, stream)
        except (RedisError, OSError) as error:
            logger.error(
                "post_upstream_failed",
                request_id=message.request_id,
                stream=stream,
                error=str(error),
            )
            if is_submit:
                code, text = client_refusal(error)
                return self._session.on_submit_refused(message.request_id, code, text)
        except Exception:
            # A bug (a message that cannot be encoded, say) ends this request
            # with an error; it must not take the socket down with it.
            logger.exception("post_upstream_crashed", request_id=message.request_id)
            if is_submit:
                return self._session.on_submit_refused(
                    message.request_id, "internal", UNAVAILABLE_MESSAGE
                )
        return []

    async def _post_until_known(self, action: PostUpstream, stream: str) -> None:
        """One transaction: a request is submitted only with its log started.

        A transaction cut off by a lost connection may or may not have run (Redis
        can run an EXEC and then close the connection on its way down), and
        redis-py does not retry a MULTI/EXEC on a pooled connection the server
        closed. So on a lost connection the idle connections, as stale as that
        one, are dropped and the post is tried again with backoff for up to
        POST_RETRY_S; before posting a submit again, its log tells whether the
        earlier transaction ran (the log is written in the same transaction).
        Raises the last error once the time is up (the outcome is then unknown
        only if that last transaction was itself cut off mid-way).
        """
        deadline_s = time.monotonic() + POST_RETRY_S
        entry = action.log_entry
        failures = 0
        while True:
            try:
                if failures and isinstance(entry, RequestRecord) and await self._logged(entry):
                    return
                pipe = self._redis.pipeline(transaction=True)
                if isinstance(entry, RequestRecord):
                    queue_record(pipe, self._keys, entry)
                elif entry is not None:
                    queue_end(pipe, self._keys, entry, self._log_retention_s)
                xadd_message(pipe, stream, action.message)
                await pipe.execute()
                return
            except (RedisConnectionError, RedisTimeoutError):
                if time.monotonic() + reconnect_backoff_s(failures) > deadline_s:
                    raise
                logger.info("post_upstream_retried", stream=stream)
                await self._redis.connection_pool.disconnect(inuse_connections=False)
                await asyncio.sleep(reconnect_backoff_s(failures))
                failures += 1

    async def _logged(self, record: RequestRecord) -> bool:
        """Whether the request's log exists: its submit's transaction ran."""
        return bool(await self._redis.exists(self._keys.request_log(record.submit.request_id)))

    async def dead_letter(self, action: DeadLetter) -> None:
        """Keep a message nobody could handle in the dead stream (logged when Redis refuses)."""
        try:
            await dead_letter(
                self._redis, self._keys.dead, action.source, action.error, action.data
            )
        except (RedisError, OSError) as error:
            logger.error("dead_letter_failed", error=str(error))

    async def _reserve_tokens(
        self, reservation: TokenReservation, request_id: str
    ) -> list[Action] | None:
        """Take the request's tokens from its tenant's budget of this minute, in a
        counter all gateways share; the actions that end it when over (else None)."""
        window, retry_in_s = tokens_window(time.time())
        key = self._keys.tenant_tokens(reservation.tenant, window)
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.incrby(key, reservation.num_tokens)
            # Two windows: the counter outlives its minute even on a skewed clock.
            pipe.expire(key, 2 * TOKENS_WINDOW_S)
            num_reserved, _ = await pipe.execute()
            if int(num_reserved) <= reservation.tokens_per_minute:
                return None
            # A refused request takes nothing: give its tokens back.
            await self._redis.decrby(key, reservation.num_tokens)
        except (RedisError, OSError) as error:
            logger.error("tokens_not_reserved", request_id=request_id, error=str(error))
            code, text = client_refusal(error)
            return self._session.on_submit_refused(request_id, code, text)
        message = over_tokens_per_minute(
            reservation, int(num_reserved) - reservation.num_tokens, retry_in_s
        )
        logger.info("tokens_per_minute_exceeded", request_id=request_id)
        return self._session.on_submit_refused(request_id, "queue_full", message)
