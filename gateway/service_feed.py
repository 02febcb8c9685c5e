"""What the service says about this gateway's requests, in: token batches and
rejections from the gateway's pub/sub channel, and the entries of request
logs it follows. Pure, like the session that owns it; what clients say is
``gateway/session.py``'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast, get_args

import msgspec
import structlog

from gateway.actions import Action, DeadLetter, PostUpstream
from gateway.frames import error_frames, stream_frames
from gateway.request_stream import RequestStream
from gateway.request_table import RequestTable
from shared.messages import (
    CancelRequest,
    RequestEnded,
    RequestFailed,
    RequestLogEntry,
    RequestRejected,
    TokenBatch,
    decode_gateway_message,
    encode,
)
from shared.protocol import ErrorCode

logger = structlog.get_logger(__name__)

ERROR_CODES: frozenset[str] = frozenset(get_args(ErrorCode))
LOG_SOURCE = "request log"


def known_code(code: str) -> ErrorCode:
    """A code from upstream as a client error code (``internal`` when unknown)."""
    return cast(ErrorCode, code if code in ERROR_CODES else "internal")


def cancel_upstream(stream: RequestStream) -> PostUpstream:
    """Tell the scheduler to stop the request, and its log how far the client got."""
    ended = RequestEnded(request_id=stream.request_id, num_tokens=len(stream.tokens))
    return PostUpstream(CancelRequest(request_id=stream.request_id), log_entry=ended)


class ServiceFeed:
    """Applies the service's messages to the requests of ``table``."""

    def __init__(self, table: RequestTable, vocab_size: int, clock: Callable[[], float]) -> None:
        self.table = table
        self._vocab_size = vocab_size
        self._clock = clock

    def on_gateway_message(self, data: bytes, source: str) -> list[Action]:
        """A message from the gateway's tokens channel ``source``."""
        try:
            message = decode_gateway_message(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.warning("undecodable_gateway_message", source=source, error=str(error))
            return [DeadLetter(source=source, error=str(error), data=data)]
        if isinstance(message, RequestRejected):
            return self._rejected(message)
        return self._token_batch(message, source, data)

    def _token_batch(self, batch: TokenBatch, source: str, data: bytes | None) -> list[Action]:
        """The one rule for a batch, from pub/sub or a log: a token id outside the
        vocabulary makes the whole batch a dead letter (checked before any of it
        is applied: a batch is taken whole or not at all)."""
        bad = [t for t in batch.tokens if not 0 <= t.token_id < self._vocab_size]
        if bad:
            reason = f"token id {bad[0].token_id} is outside the vocabulary"
            logger.warning("malformed_token_batch", source=source, error=reason)
            return [DeadLetter(source=source, error=reason, data=data or encode(batch))]
        return self._tokens(batch)

    def _tokens(self, batch: TokenBatch) -> list[Action]:
        now_s = self._clock()
        actions: list[Action] = []
        for token in batch.tokens:
            stream = self.table.stream(token.request_id)
            # Tokens of a request that ended here (cancel, stop string) still come
            # until the scheduler has taken the cancel; they are dropped.
            if stream is None or stream.finished:
                continue
            update = stream.add(token, now_s)
            route = self.table.route(stream.request_id)
            if route is not None:
                actions += stream_frames(route.socket_id, route.client_id, update.events)
            if update.cancel_upstream:
                actions.append(cancel_upstream(stream))
            if stream.finished:
                self.table.finish(stream)
        return actions

    def _rejected(self, rejected: RequestRejected) -> list[Action]:
        stream = self.table.stream(rejected.request_id)
        if stream is None or stream.finished:
            return []
        logger.info(
            "request_rejected",
            request_id=rejected.request_id,
            code=rejected.code,
        )
        return self._failed(rejected.request_id, rejected.code, rejected.message)

    def _failed(self, request_id: str, code: str, message: str) -> list[Action]:
        """The service ended a request with an error: the client gets it, with a known code."""
        return self.end_with_error(request_id, known_code(code), message)

    def end_with_error(self, request_id: str, code: ErrorCode, message: str) -> list[Action]:
        """A live request ends in an ``error`` (refused upstream, failed): it is
        forgotten here, and its client, if attached, gets the error."""
        stream = self.table.stream(request_id)
        if stream is None or stream.finished:
            return []
        route = self.table.route(request_id)
        self.table.forget(stream)
        if route is None:
            return []
        return error_frames(route.socket_id, code, message, route.client_id)

    def on_log_entries(
        self, request_id: str, entries: Sequence[RequestLogEntry], source: str = LOG_SOURCE
    ) -> list[Action]:
        """New entries of a request's log ``source``; tokens already here are skipped."""
        stream = self.table.stream(request_id)
        if stream is None or stream.finished:
            return []
        actions: list[Action] = []
        for entry in entries:
            if isinstance(entry, TokenBatch):
                actions += self._token_batch(entry, source, None)
            elif isinstance(entry, RequestEnded):
                # Another gateway ended it (its client cancelled, or its socket closed).
                route = self.table.route(request_id)
                completion = stream.cancel(self._clock())
                if route is not None:
                    actions += stream_frames(route.socket_id, route.client_id, [completion])
                self.table.finish(stream)
            elif isinstance(entry, RequestFailed):
                # The service ended it with an error (its gateway got a RequestRejected).
                actions += self._failed(request_id, entry.code, entry.message)
                break
            if stream.finished:
                break
        return actions
