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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast, get_args

import msgspec
import structlog

from gateway.actions import (
    Action,
    DeadLetter,
    FollowLog,
    LoadLog,
    PostUpstream,
    SendFrame,
    ServerFrame,
)
from gateway.request_stream import Completion, EmittedToken, RequestStream, StreamEvent
from gateway.tenants import Tenant, TokenReservation
from gateway.tokenizer import ChatTokenizer, IncrementalDetokenizer
from gateway.validation import ModelLimits, RequestValidationError, validate_generate
from shared.messages import (
    CancelRequest,
    RequestAdopted,
    RequestEnded,
    RequestRecord,
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
from shared.request_log import RequestLog

logger = structlog.get_logger(__name__)

ERROR_CODES: frozenset[str] = frozenset(get_args(ErrorCode))
SHUTTING_DOWN_MESSAGE = "gateway is shutting down, reconnect elsewhere"


@dataclass(frozen=True)
class SessionConfig:
    """The core's knobs, taken from GatewaySettings by the shell."""

    gateway_id: str
    max_frame_bytes: int = 1 << 20
    max_requests_per_socket: int = 64
    tenant: str = "default"
    # How long a finished request's frames stay available to `resume`.
    retention_s: float = 60.0
    # How long a request whose socket closed keeps running, waiting for a
    # `resume` (a network blip must not cost the answer); 0: cancel at once.
    detach_grace_s: float = 0.0


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
        # socket id -> the tenant its handshake authenticated.
        self._socket_tenants: dict[int, Tenant] = {}
        # Live and recently finished requests (the latter kept for resume).
        self._streams: dict[str, RequestStream] = {}
        # (cancel_at_s, request_id) of requests whose socket closed, in closing order.
        self._detached: deque[tuple[float, str]] = deque()
        # (finished_at_s, request_id) in finishing order, so expiry is O(1) per request.
        self._finished: deque[tuple[float, str]] = deque()
        # Set on shutdown: requests in flight go on, new ones are refused.
        self._draining = False

    @property
    def num_sockets(self) -> int:
        """Open sockets."""
        return len(self._sockets)

    @property
    def num_live_requests(self) -> int:
        """Requests in flight on open sockets (what a graceful shutdown waits for)."""
        return sum(len(requests) for requests in self._sockets.values())

    def start_draining(self) -> None:
        """From now on every ``generate`` is refused; requests in flight go on."""
        self._draining = True

    def live_request_ids(self, socket_id: int) -> list[str]:
        """The service's ids of the requests in flight on one socket."""
        return list(self._sockets.get(socket_id, {}).values())

    def stream(self, request_id: str) -> RequestStream | None:
        """A live or retained request, if known."""
        return self._streams.get(request_id)

    # --- sockets ---------------------------------------------------------------------

    def connect(self, tenant: Tenant | None = None) -> int:
        """A socket of ``tenant`` opened (default: the open tenant of the config);
        returns the id the other calls name it by."""
        socket_id = self._next_socket_id
        self._next_socket_id += 1
        self._sockets[socket_id] = {}
        self._socket_tenants[socket_id] = tenant or Tenant(name=self.config.tenant)
        return socket_id

    def disconnect(self, socket_id: int) -> list[Action]:
        """A socket closed: its live requests keep running for ``detach_grace_s``,
        waiting for a ``resume`` (``on_tick`` cancels them after that); with no
        grace, or while draining, they are cancelled upstream at once (their
        log stays for resume either way)."""
        self._expire()
        requests = self._sockets.pop(socket_id, {})
        self._socket_tenants.pop(socket_id, None)
        now_s = self._clock()
        streams = [self._streams[request_id] for request_id in requests.values()]
        for stream in streams:
            stream.socket_id = None
        if self.config.detach_grace_s > 0 and not self._draining:
            deadline_s = now_s + self.config.detach_grace_s
            self._detached.extend((deadline_s, stream.request_id) for stream in streams)
            if streams:
                logger.info("socket closed, requests wait for a resume", num_requests=len(streams))
            return []
        if streams:
            logger.info("socket closed, requests cancelled", num_requests=len(streams))
        return [self._cancel_detached(stream, now_s) for stream in streams]

    def on_tick(self) -> list[Action]:
        """Called every second or so: cancel the requests whose socket closed more
        than ``detach_grace_s`` ago and that nobody resumed meanwhile."""
        self._expire()
        now_s = self._clock()
        actions: list[Action] = []
        while self._detached and self._detached[0][0] <= now_s:
            _, request_id = self._detached.popleft()
            stream = self._streams.get(request_id)
            if stream is not None and stream.socket_id is None and not stream.finished:
                # Another gateway may have taken it over: the scheduler, which
                # knows, decides; a later resume (anywhere) reads the log.
                logger.info("request not resumed here in time", request_id=request_id)
                self._forget(stream)
                cancel = CancelRequest(request_id=request_id, gateway_id=self.config.gateway_id)
                actions.append(PostUpstream(cancel))
        return actions

    def _cancel_detached(self, stream: RequestStream, now_s: float) -> PostUpstream:
        stream.cancel(now_s)
        self._retain(stream)
        return _cancel_upstream(stream)

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
        return self.on_submit_refused(
            request_id, "internal", f"could not queue the request: {reason}"
        )

    def on_submit_refused(self, request_id: str, code: ErrorCode, message: str) -> list[Action]:
        """The shell did not post the SubmitRequest (the tenant's tokens per
        minute are spent): the accepted request ends in an ``error`` at once."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return []
        self._forget(stream)
        if stream.socket_id is None:
            return []
        return self._error(stream.socket_id, code, message, stream.client_id)

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
                actions.append(_cancel_upstream(stream))
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
        if self._draining:
            return self._error(socket_id, "queue_full", SHUTTING_DOWN_MESSAGE, generate.id)
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
        tenant = self._socket_tenants[socket_id]
        cap = tenant.max_tokens_per_request
        if cap is not None and generate.max_tokens > cap:
            return self._error(
                socket_id,
                "invalid_request",
                f"max_tokens {generate.max_tokens} is over tenant {tenant.name!r}'s limit of {cap}",
                generate.id,
            )
        try:
            validated = validate_generate(generate, self._tokenizer, self._limits)
        except RequestValidationError as error:
            return self._error(socket_id, error.code, error.message, generate.id)
        reservation = _reservation(tenant, len(validated.prompt_ids) + generate.max_tokens)
        if reservation is not None and reservation.num_tokens > reservation.tokens_per_minute:
            return self._error(
                socket_id,
                "invalid_request",
                f"prompt plus max_tokens is {reservation.num_tokens} tokens, more than tenant "
                f"{tenant.name!r}'s tokens-per-minute limit of {reservation.tokens_per_minute}",
                generate.id,
            )
        if len(requests) >= self.config.max_requests_per_socket:
            return self._error(socket_id, "queue_full", self._too_many_message(), generate.id)
        request_id = self._new_request_id()
        self._streams[request_id] = RequestStream(
            request_id=request_id,
            tenant=tenant.name,
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
            tenant=tenant.name,
            prompt_ids=validated.prompt_ids,
            sampling=validated.sampling,
            limits=tenant.limits,
        )
        # `accepted` first: a later `error` for the id (submit failed, scheduler
        # refused) then reads as the end of an accepted request, like `done`.
        record = RequestRecord(submit=submit, client_id=generate.id, stop=list(generate.stop))
        return [
            SendFrame(socket_id, Accepted(id=generate.id, request_id=request_id)),
            PostUpstream(submit, log_entry=record, reservation=reservation),
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
        return [_cancel_upstream(stream), *self._frames(socket_id, cancel.id, [completion])]

    def _resume(self, socket_id: int, resume: Resume) -> list[Action]:
        stream = self._streams.get(resume.request_id)
        if stream is None:
            # Maybe accepted by another gateway (one that died): its log says.
            return [LoadLog(socket_id, resume.request_id, resume)]
        if stream.tenant != self._socket_tenants[socket_id].name:
            # Answered exactly like an unknown id: another tenant's request never shows.
            return self._unknown_request(socket_id, resume)
        client_id = resume.id if resume.id is not None else stream.original_client_id
        if not stream.finished:
            refusal = self._attach(socket_id, stream, client_id)
            if refusal is not None:
                return refusal
        return self._frames(socket_id, client_id, stream.replay(resume.after_seq))

    def on_log_loaded(self, socket_id: int, resume: Resume, log: RequestLog | None) -> list[Action]:
        """The log a ``LoadLog`` asked for (None: there is none): take the request
        over from the gateway that accepted it and serve the ``resume``."""
        self._expire()
        if socket_id not in self._sockets:
            return []
        if resume.request_id in self._streams:
            # Meanwhile known here (two resumes raced): serve it as usual.
            return self._resume(socket_id, resume)
        if log is None or log.record.submit.tenant != self._socket_tenants[socket_id].name:
            return self._unknown_request(socket_id, resume)
        submit = log.record.submit
        stream = RequestStream(
            request_id=submit.request_id,
            tenant=submit.tenant,
            client_id=log.record.client_id,
            socket_id=None,
            num_prompt_tokens=len(submit.prompt_ids),
            max_tokens=submit.sampling.max_tokens,
            detokenizer=IncrementalDetokenizer(self._tokenizer, submit.prompt_ids),
            stop=log.record.stop,
            accepted_at_s=self._clock(),
        )
        self._streams[stream.request_id] = stream
        now_s = self._clock()
        for token in log.sampled_tokens():
            stream.add(token, now_s)
        if log.ended_after is not None and not stream.finished:
            stream.cancel(now_s)
        if stream.finished:
            self._retain(stream)
        logger.info("request taken over from its log", request_id=stream.request_id)
        actions = self._resume(socket_id, resume)
        if not stream.finished and stream.socket_id == socket_id:
            adopted = RequestAdopted(stream.request_id, self.config.gateway_id)
            actions += [FollowLog(stream.request_id, log.last_entry_id), PostUpstream(adopted)]
        return actions

    def on_log_entries(
        self, request_id: str, entries: Sequence[RequestRecord | TokenBatch | RequestEnded]
    ) -> list[Action]:
        """New entries of a request's log (followed, or read again to fill what
        pub/sub lost while Redis was unreachable); tokens already here are skipped."""
        self._expire()
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return []
        actions: list[Action] = []
        for entry in entries:
            if isinstance(entry, TokenBatch):
                tokens = [t for t in entry.tokens if 0 <= t.token_id < self._limits.vocab_size]
                actions += self._tokens(TokenBatch(worker_id=entry.worker_id, tokens=tokens))
            elif isinstance(entry, RequestEnded) and not stream.finished:
                # Another gateway ended it (its client cancelled, or its socket closed).
                completion = stream.cancel(self._clock())
                if stream.socket_id is not None:
                    actions += self._frames(stream.socket_id, stream.client_id, [completion])
                self._finish(stream)
            if stream.finished:
                break
        return actions

    def unfinished_request_ids(self) -> list[str]:
        """Every request still running here."""
        return [request_id for request_id, s in self._streams.items() if not s.finished]

    def _unknown_request(self, socket_id: int, resume: Resume) -> list[Action]:
        return self._error(
            socket_id,
            "invalid_request",
            f"unknown request_id {resume.request_id!r} (never accepted, or finished too long ago)",
            resume.id,
        )

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
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # deep nesting
        return None


def _reservation(tenant: Tenant, num_tokens: int) -> TokenReservation | None:
    """What a request takes of its tenant's per-minute budget (None: no budget)."""
    if tenant.tokens_per_minute is None:
        return None
    return TokenReservation(
        tenant=tenant.name, num_tokens=num_tokens, tokens_per_minute=tenant.tokens_per_minute
    )


def _cancel_upstream(stream: RequestStream) -> PostUpstream:
    """Tell the scheduler to stop the request, and its log how far the client got."""
    ended = RequestEnded(request_id=stream.request_id, num_tokens=len(stream.tokens))
    return PostUpstream(CancelRequest(request_id=stream.request_id), log_entry=ended)
