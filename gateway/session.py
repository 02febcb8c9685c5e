"""The gateway's protocol core: sans-IO, no asyncio, no Redis, no websockets.

Events go in (a socket opened, a client frame, a message from the gateway's
pub/sub channel, a socket closed) and actions come out, in the order the
shell must carry them out: frames to send to a socket, messages to add to a
Redis stream, undecodable messages for the dead stream. Time comes from an
injected clock, request ids from an injected factory, so tests drive it
directly.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast, get_args

import msgspec
import structlog

from gateway.actions import Action, DeadLetter, PostUpstream, SendFrame, ServerFrame
from gateway.request_stream import Completion, EmittedToken, RequestStream, StreamEvent
from gateway.tokenizer import ChatTokenizer, IncrementalDetokenizer
from gateway.validation import ModelLimits, RequestValidationError, validate_generate
from shared.messages import (
    CancelRequest,
    RequestRejected,
    SubmitRequest,
    TokenBatch,
    decode_gateway_message,
)
from shared.protocol import (
    Accepted,
    Cancel,
    Done,
    Error,
    ErrorCode,
    Generate,
    Resume,
    Token,
    decode_client_message,
)

logger = structlog.get_logger(__name__)

ERROR_CODES: frozenset[str] = frozenset(get_args(ErrorCode))


@dataclass(frozen=True)
class SessionConfig:
    """The core's knobs, taken from GatewaySettings by the shell."""

    gateway_id: str
    max_frame_bytes: int = 1 << 20
    max_requests_per_socket: int = 64
    tenant: str = "default"
    # How long a finished request's frames stay available to `resume`.
    retention_s: float = 60.0


class _ClientIdProbe(msgspec.Struct):
    """Just the ``id`` of a frame that failed validation, to name it in the error."""

    id: str | None = None


class GatewaySession:
    """Every socket and request of one gateway process."""

    def __init__(
        self,
        config: SessionConfig,
        tokenizer: ChatTokenizer,
        limits: ModelLimits,
        clock: Callable[[], float],
        new_request_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._limits = limits
        self._clock = clock
        self._new_request_id = new_request_id
        self._next_socket_id = 0
        # socket id -> (client id -> request id) of its live requests.
        self._sockets: dict[int, dict[str, str]] = {}
        # Live and recently finished requests (the latter kept for resume).
        self._streams: dict[str, RequestStream] = {}
        # (finished_at_s, request_id) in finishing order, so expiry is O(1) per request.
        self._finished: deque[tuple[float, str]] = deque()

    @property
    def num_sockets(self) -> int:
        """Open sockets."""
        return len(self._sockets)

    def live_request_ids(self, socket_id: int) -> list[str]:
        """The service's ids of the requests in flight on one socket."""
        return list(self._sockets.get(socket_id, {}).values())

    def stream(self, request_id: str) -> RequestStream | None:
        """A live or retained request, if known."""
        return self._streams.get(request_id)

    # --- sockets ---------------------------------------------------------------------

    def connect(self) -> int:
        """A socket opened; returns the id the other calls name it by."""
        socket_id = self._next_socket_id
        self._next_socket_id += 1
        self._sockets[socket_id] = {}
        return socket_id

    def disconnect(self, socket_id: int) -> list[Action]:
        """A socket closed: cancel its live requests upstream (their log stays for resume)."""
        self._expire()
        requests = self._sockets.pop(socket_id, {})
        now_s = self._clock()
        actions: list[Action] = []
        for request_id in requests.values():
            stream = self._streams[request_id]
            stream.socket_id = None
            stream.cancel(now_s)
            self._retain(stream)
            actions.append(PostUpstream(CancelRequest(request_id=request_id)))
        if requests:
            logger.info("socket closed, requests cancelled", num_requests=len(requests))
        return actions

    def on_frame(self, socket_id: int, frame: str | bytes) -> list[Action]:
        """A frame from the client on ``socket_id``."""
        self._expire()
        if isinstance(frame, bytes):
            return self._error(socket_id, "invalid_request", "binary frames are not supported")
        if _is_over_bytes(frame, self.config.max_frame_bytes):
            return self._error(
                socket_id,
                "invalid_request",
                f"frame over the limit of {self.config.max_frame_bytes} bytes",
            )
        try:
            message = decode_client_message(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            return self._error(socket_id, "invalid_request", str(error), _probe_client_id(frame))
        if isinstance(message, Generate):
            return self._generate(socket_id, message)
        if isinstance(message, Cancel):
            return self._cancel(socket_id, message)
        return self._resume(socket_id, message)

    def on_submit_failed(self, request_id: str, reason: str) -> list[Action]:
        """The SubmitRequest could not be added to Redis: the request ends in an error."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return []
        self._forget(stream)
        if stream.socket_id is None:
            return []
        return self._error(
            stream.socket_id, "internal", f"could not queue the request: {reason}", stream.client_id
        )

    # --- the gateway's pub/sub channel -------------------------------------------------

    def on_gateway_message(self, data: bytes, source: str) -> list[Action]:
        """A message from the gateway's tokens channel ``source``."""
        self._expire()
        try:
            message = decode_gateway_message(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.warning("undecodable gateway message", source=source, error=str(error))
            return [DeadLetter(source=source, error=str(error), data=data)]
        if isinstance(message, RequestRejected):
            return self._rejected(message)
        bad = [t for t in message.tokens if not 0 <= t.token_id < self._limits.vocab_size]
        if bad:
            # Checked before any of it is applied: a batch is taken whole or not at all.
            reason = f"token id {bad[0].token_id} is outside the vocabulary"
            logger.warning("malformed token batch", source=source, error=reason)
            return [DeadLetter(source=source, error=reason, data=data)]
        return self._tokens(message)

    def _tokens(self, batch: TokenBatch) -> list[Action]:
        now_s = self._clock()
        actions: list[Action] = []
        for token in batch.tokens:
            stream = self._streams.get(token.request_id)
            # Tokens of a request that ended here (cancel, stop string) still come
            # until the scheduler has taken the cancel; they are dropped.
            if stream is None or stream.finished:
                continue
            update = stream.add(token, now_s)
            if stream.socket_id is not None:
                actions.extend(self._frames(stream.socket_id, stream.client_id, update.events))
            if update.cancel_upstream:
                actions.append(PostUpstream(CancelRequest(request_id=stream.request_id)))
            if stream.finished:
                self._finish(stream)
        return actions

    def _rejected(self, rejected: RequestRejected) -> list[Action]:
        stream = self._streams.get(rejected.request_id)
        if stream is None or stream.finished:
            return []
        logger.info(
            "request rejected by the scheduler",
            request_id=rejected.request_id,
            code=rejected.code,
        )
        self._forget(stream)
        if stream.socket_id is None:
            return []
        code = cast(ErrorCode, rejected.code if rejected.code in ERROR_CODES else "internal")
        return self._error(stream.socket_id, code, rejected.message, stream.client_id)

    # --- client messages ---------------------------------------------------------------

    def _generate(self, socket_id: int, generate: Generate) -> list[Action]:
        requests = self._sockets[socket_id]
        if generate.id in requests:
            return self._error(
                socket_id,
                "invalid_request",
                f"a request with id {generate.id!r} is already in flight on this socket",
                generate.id,
            )
        # Validation before capacity: a request that can never succeed should not
        # be told to retry later.
        try:
            validated = validate_generate(generate, self._tokenizer, self._limits)
        except RequestValidationError as error:
            return self._error(socket_id, error.code, error.message, generate.id)
        if len(requests) >= self.config.max_requests_per_socket:
            return self._error(socket_id, "queue_full", self._too_many_message(), generate.id)
        request_id = self._new_request_id()
        self._streams[request_id] = RequestStream(
            request_id=request_id,
            client_id=generate.id,
            socket_id=socket_id,
            num_prompt_tokens=len(validated.prompt_ids),
            max_tokens=validated.sampling.max_tokens,
            detokenizer=IncrementalDetokenizer(self._tokenizer, validated.prompt_ids),
            stop=generate.stop,
            accepted_at_s=self._clock(),
        )
        requests[generate.id] = request_id
        submit = SubmitRequest(
            request_id=request_id,
            gateway_id=self.config.gateway_id,
            tenant=self.config.tenant,
            prompt_ids=validated.prompt_ids,
            sampling=validated.sampling,
        )
        # `accepted` first: a later `error` for the id (submit failed, scheduler
        # refused) then reads as the end of an accepted request, like `done`.
        return [
            SendFrame(socket_id, Accepted(id=generate.id, request_id=request_id)),
            PostUpstream(submit),
        ]

    def _cancel(self, socket_id: int, cancel: Cancel) -> list[Action]:
        request_id = self._sockets[socket_id].get(cancel.id)
        if request_id is None:
            return self._error(
                socket_id,
                "invalid_request",
                f"no request with id {cancel.id!r} is in flight on this socket",
                cancel.id,
            )
        stream = self._streams[request_id]
        completion = stream.cancel(self._clock())
        self._finish(stream)
        return [
            PostUpstream(CancelRequest(request_id=request_id)),
            *self._frames(socket_id, cancel.id, [completion]),
        ]

    def _resume(self, socket_id: int, resume: Resume) -> list[Action]:
        stream = self._streams.get(resume.request_id)
        if stream is None:
            return self._error(
                socket_id,
                "invalid_request",
                f"unknown request_id {resume.request_id!r} (never here, or finished too long ago)",
                resume.id,
            )
        client_id = resume.id if resume.id is not None else stream.original_client_id
        if not stream.finished:
            refusal = self._attach(socket_id, stream, client_id)
            if refusal is not None:
                return refusal
        return self._frames(socket_id, client_id, stream.replay(resume.after_seq))

    def _attach(self, socket_id: int, stream: RequestStream, client_id: str) -> list[Action] | None:
        """Move a live request's frames to ``socket_id`` under ``client_id``; None when done."""
        requests = self._sockets[socket_id]
        already_here = stream.socket_id == socket_id
        holder = requests.get(client_id)
        if holder is not None and holder != stream.request_id:
            return self._error(
                socket_id,
                "invalid_request",
                f"a request with id {client_id!r} is already in flight on this socket",
                client_id,
            )
        if not already_here and len(requests) >= self.config.max_requests_per_socket:
            return self._error(socket_id, "queue_full", self._too_many_message(), client_id)
        if stream.socket_id in self._sockets:
            # The old socket stops getting this request (and no longer cancels it on close).
            self._sockets[stream.socket_id].pop(stream.client_id, None)
        stream.socket_id = socket_id
        stream.client_id = client_id
        requests[client_id] = stream.request_id
        logger.info("request resumed", request_id=stream.request_id)
        return None

    # --- bookkeeping -------------------------------------------------------------------

    def _finish(self, stream: RequestStream) -> None:
        """The request ended: it leaves its socket, its log stays for resume a while."""
        if stream.socket_id in self._sockets:
            self._sockets[stream.socket_id].pop(stream.client_id, None)
        self._retain(stream)

    def _retain(self, stream: RequestStream) -> None:
        assert stream.finished_at_s is not None
        self._finished.append((stream.finished_at_s, stream.request_id))

    def _forget(self, stream: RequestStream) -> None:
        if stream.socket_id in self._sockets:
            self._sockets[stream.socket_id].pop(stream.client_id, None)
        del self._streams[stream.request_id]

    def _expire(self) -> None:
        horizon_s = self._clock() - self.config.retention_s
        while self._finished and self._finished[0][0] <= horizon_s:
            _, request_id = self._finished.popleft()
            self._streams.pop(request_id, None)

    def _too_many_message(self) -> str:
        return (
            f"this socket already has {self.config.max_requests_per_socket} requests in flight"
            " (the most allowed)"
        )

    def _frames(self, socket_id: int, client_id: str, events: list[StreamEvent]) -> list[Action]:
        actions: list[Action] = []
        for event in events:
            if isinstance(event, EmittedToken):
                frame: ServerFrame = Token(
                    id=client_id, seq=event.seq, text=event.text, token_id=event.token_id
                )
            else:
                frame = _done(client_id, event)
            actions.append(SendFrame(socket_id, frame))
        return actions

    def _error(
        self, socket_id: int, code: ErrorCode, message: str, client_id: str | None = None
    ) -> list[Action]:
        return [SendFrame(socket_id, Error(code=code, message=message, id=client_id))]


def _done(client_id: str, completion: Completion) -> Done:
    return Done(
        id=client_id,
        finish_reason=completion.finish_reason,
        usage=completion.usage,
        timings=completion.timings,
    )


def _is_over_bytes(frame: str, limit: int) -> bool:
    """True when ``frame`` takes more than ``limit`` bytes in UTF-8."""
    # A character takes 1 to 4 bytes, so most frames are decided without encoding.
    if len(frame) * 4 <= limit:
        return False
    if len(frame) > limit:
        return True
    return len(frame.encode("utf-8", errors="surrogatepass")) > limit


def _probe_client_id(frame: str) -> str | None:
    try:
        return msgspec.json.decode(frame, type=_ClientIdProbe).id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
