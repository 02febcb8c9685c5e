"""The gateway's protocol core: sans-IO, no asyncio, no Redis, no websockets.

Owns the protocol's rules for what clients say: what a client frame, a
tokenized prompt, a loaded request log (a resume), a close or a tick does to
the requests (``gateway/request_table.py`` holds them, ``gateway/admission.py``
says which are taken on, ``gateway/service_feed.py`` applies what the service
says of them), and the actions (``gateway/actions.py``) the shell carries out
in order. Time comes from an
injected clock, request ids from an injected factory. The flow is described
in ``docs/architecture.md`` (*Gateway*).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from gateway.actions import (
    Action,
    FollowLog,
    LoadLog,
    PostUpstream,
    SendFrame,
    Tokenize,
    Wait,
)
from gateway.admission import SHUTTING_DOWN_MESSAGE, Admission, AdmissionLimits, AdmissionRefused
from gateway.frames import error_frames, refusal_frames, stream_frames
from gateway.refusal import Refused
from gateway.refusal_pacer import RefusalPacer
from gateway.request_stream import RequestStream
from gateway.request_table import PendingRequest, RequestTable, Route
from gateway.service_feed import LOG_SOURCE, ServiceFeed, cancel_upstream, known_code
from gateway.tenants import OPEN_TENANT_NAME, Tenant
from gateway.tokenizer import ChatTokenizer
from gateway.validation import (
    ModelLimits,
    ValidatedRequest,
    check_generate,
    min_request_tokens,
    num_prompt_chars,
)
from shared.messages import (
    CancelRequest,
    RequestAdopted,
    RequestLogEntry,
    RequestRecord,
    SubmitRequest,
)
from shared.protocol import (
    Accepted,
    Cancel,
    Done,
    ErrorCode,
    Generate,
    Resume,
    Timings,
    Usage,
    decode_client_message,
)
from shared.request_log import RequestLog

__all__ = ["SHUTTING_DOWN_MESSAGE", "GatewaySession", "SessionConfig"]

logger = structlog.get_logger(__name__)

# A refusal held back for less is answered at once.
MIN_WAIT_S = 0.001


@dataclass(frozen=True)
class SessionConfig:
    """The core's knobs, taken from GatewaySettings by the shell."""

    gateway_id: str
    max_frame_bytes: int = 1 << 20
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    # The tenant of sockets opened without one (the open tenant).
    tenant: str = OPEN_TENANT_NAME
    # How long a finished request's frames stay available to `resume`.
    retention_s: float = 60.0
    # How long a request whose socket closed keeps running, waiting for a
    # `resume` (a network blip must not cost the answer); 0: cancel at once.
    detach_grace_s: float = 0.0
    # A request without a token (or its end) this long since it was accepted
    # or since its last token ends in an error: nothing lost waits forever.
    stall_timeout_s: float = 300.0
    # A tenant's refused generates are answered no faster than this many
    # characters of their prompts a second (gateway/refusal_pacer.py).
    max_refused_chars_per_s: float = 2_000_000.0


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
        self.table = RequestTable(config.retention_s, clock)
        self.feed = ServiceFeed(self.table, limits.vocab_size, clock)
        self._admission = Admission(config.admission)
        self._refusals = RefusalPacer(config.max_refused_chars_per_s)

    @property
    def num_sockets(self) -> int:
        """Open sockets."""
        return self.table.num_sockets

    @property
    def num_live_requests(self) -> int:
        """Requests in flight on open sockets (what a graceful shutdown waits for)."""
        return self.table.num_attached

    @property
    def draining(self) -> bool:
        """Shutting down: every new ``generate`` is refused."""
        return self._admission.draining

    def start_draining(self) -> None:
        """From now on every ``generate`` is refused; requests in flight go on."""
        self._admission.draining = True

    def live_request_ids(self, socket_id: int) -> list[str]:
        """The service's ids of the requests in flight on one socket."""
        return self.table.request_ids_on(socket_id)

    def stream(self, request_id: str) -> RequestStream | None:
        """A live or retained request, if known."""
        return self.table.stream(request_id)

    def unfinished_request_ids(self) -> list[str]:
        """Every request still running here."""
        return [stream.request_id for stream in self.table.live_streams()]

    # --- sockets ---------------------------------------------------------------------

    def connect(
        self, tenant: Tenant | None = None, key_hash: str | None = None, *, resumable: bool = True
    ) -> int:
        """A socket of ``tenant`` opened (default: the open tenant of the config),
        with the API key of sha256 ``key_hash``; returns the id the other calls
        name it by. The requests of a socket that is not ``resumable`` (an HTTP
        request's) can never be resumed, by anyone."""
        return self.table.open_socket(
            tenant or Tenant(name=self.config.tenant), key_hash, resumable=resumable
        )

    def disconnect(self, socket_id: int, *, resumable: bool = True) -> list[Action]:
        """A socket closed: its live requests keep running for ``detach_grace_s``,
        waiting for a ``resume`` (``on_tick`` cancels them after that); with no
        grace, while draining, or for a client that cannot resume (an HTTP
        request: ``resumable`` False), they are cancelled upstream at once
        (their log stays for resume either way). Prompts still being tokenized
        are dropped."""
        self.table.expire()
        streams, _ = self.table.close_socket(socket_id)
        now_s = self._clock()
        if resumable and self.config.detach_grace_s > 0 and not self._admission.draining:
            deadline_s = now_s + self.config.detach_grace_s
            for stream in streams:
                self.table.detach_later(stream.request_id, deadline_s)
            if streams:
                logger.info("requests_detached", num_requests=len(streams))
            return []
        if streams:
            logger.info("requests_cancelled_on_close", num_requests=len(streams))
        actions: list[Action] = []
        for stream in streams:
            stream.cancel(now_s)
            self.table.finish(stream)
            actions.append(cancel_upstream(stream))
        return actions

    def on_tick(self) -> list[Action]:
        """Called every second or so: cancel the requests whose socket closed more
        than ``detach_grace_s`` ago and that nobody resumed meanwhile, and end
        the requests that made no progress for ``stall_timeout_s``."""
        self.table.expire()
        now_s = self._clock()
        actions: list[Action] = []
        for stream in self.table.due_detached(now_s):
            # Another gateway may have taken it over: the scheduler, which
            # knows, decides; a later resume (anywhere) reads the log.
            logger.info("request_not_resumed", request_id=stream.request_id)
            self.table.forget(stream)
            cancel = CancelRequest(request_id=stream.request_id, gateway_id=self.config.gateway_id)
            actions.append(PostUpstream(cancel))
        horizon_s = now_s - self.config.stall_timeout_s
        for stream in [s for s in self.table.live_streams() if s.last_progress_s <= horizon_s]:
            actions += self._stalled(stream, now_s)
        return actions

    def _stalled(self, stream: RequestStream, now_s: float) -> list[Action]:
        logger.warning(
            "request_stalled",
            request_id=stream.request_id,
            stall_timeout_s=self.config.stall_timeout_s,
        )
        route = self.table.route(stream.request_id)
        stream.cancel(now_s)
        self.table.finish(stream)
        actions: list[Action] = [cancel_upstream(stream)]
        if route is not None:
            message = f"the request made no progress for {self.config.stall_timeout_s:g} s"
            actions += error_frames(route.socket_id, "internal", message, route.client_id)
        return actions

    def on_frame(self, socket_id: int, frame: str | bytes) -> list[Action]:
        """A frame from the client on ``socket_id``."""
        self.table.expire()
        if isinstance(frame, bytes):
            return error_frames(socket_id, "invalid_request", "binary frames are not supported")
        if _is_over_bytes(frame, self.config.max_frame_bytes):
            return error_frames(
                socket_id,
                "invalid_request",
                f"frame over the limit of {self.config.max_frame_bytes} bytes",
            )
        try:
            message = decode_client_message(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            return error_frames(socket_id, "invalid_request", str(error), _probe_client_id(frame))
        if isinstance(message, Generate):
            return self._generate(socket_id, message)
        if isinstance(message, Cancel):
            return self._cancel(socket_id, message)
        return self._resume(socket_id, message)

    def on_generate(self, socket_id: int, generate: Generate) -> list[Action]:
        """A ``generate`` that came in another form than a frame (an OpenAI
        request, translated by ``gateway/openai_api.py``): checked, admitted
        and answered exactly as the frame would be."""
        self.table.expire()
        return self._generate(socket_id, generate)

    # --- a generate: checked, tokenized off the loop, then submitted -----------------

    def _generate(self, socket_id: int, generate: Generate) -> list[Action]:
        # What can never succeed is said before what may succeed later (the caps);
        # a prompt certainly too long, from its bytes, before it is tokenized.
        tenant = self.table.socket(socket_id).tenant
        try:
            self._admission.check_generate(self.table, socket_id, generate)
            check_generate(generate, self._limits)
            min_num_tokens = min_request_tokens(
                generate, self._tokenizer, self._limits, tenant.max_tokens_per_request
            )
            self._admission.check_tokens_per_minute(tenant, min_num_tokens)
            self._admission.check_capacity(self.table, socket_id)
        except Refused as refused:
            return self._paced(
                tenant, num_prompt_chars(generate), refusal_frames(socket_id, refused, generate.id)
            )
        request_id = self._new_request_id()
        self.table.reserve(PendingRequest(request_id, tenant, Route(socket_id, generate.id)))
        return [
            Tokenize(
                request_id,
                generate,
                tenant,
                num_chars=num_prompt_chars(generate),
                max_tokens_cap=tenant.max_tokens_per_request,
            )
        ]

    def on_tokenized(
        self, request_id: str, generate: Generate, validated: ValidatedRequest
    ) -> list[Action]:
        """The prompt of pending ``request_id`` is tokenized: accept and submit it
        (unless it was cancelled, or its socket closed, meanwhile)."""
        pending = self.table.take_pending(request_id)
        if pending is None:
            return []
        socket_id, client_id = pending.route.socket_id, pending.route.client_id
        tenant = pending.tenant
        num_prompt_tokens = len(validated.prompt_ids)
        try:
            reservation = self._admission.reservation(
                tenant, num_prompt_tokens + validated.sampling.max_tokens
            )
        except AdmissionRefused as refused:
            return refusal_frames(socket_id, refused, client_id)
        submit = SubmitRequest(
            request_id=request_id,
            gateway_id=self.config.gateway_id,
            tenant=tenant.name,
            prompt_ids=validated.prompt_ids,
            sampling=validated.sampling,
            limits=self._admission.scheduler_limits(tenant),
        )
        resumable = self.table.socket(socket_id).resumable
        stream = RequestStream.of_submit(
            submit, client_id, generate.stop, self._tokenizer, self._clock(), resumable=resumable
        )
        self.table.add(stream, pending.route)
        # `accepted` first: a later `error` for the id (submit failed, scheduler
        # refused) then reads as the end of an accepted request, like `done`.
        record = RequestRecord(
            submit=submit, client_id=client_id, stop=list(generate.stop), resumable=resumable
        )
        return [
            SendFrame(socket_id, Accepted(id=client_id, request_id=request_id)),
            PostUpstream(submit, log_entry=record, reservation=reservation),
        ]

    def on_tokenize_failed(
        self, request_id: str, refused: Refused, num_chars: int = 0
    ) -> list[Action]:
        """The prompt of pending ``request_id`` (``num_chars`` characters) was
        refused (too long, a bad template) or could not be tokenized now
        (``queue_full``): refused as paced, unless the fault is the gateway's."""
        pending = self.table.take_pending(request_id)
        if pending is None:
            return []
        frames = refusal_frames(pending.route.socket_id, refused, pending.route.client_id)
        if refused.code == "internal":
            return frames
        return self._paced(pending.tenant, num_chars, frames)

    def _paced(self, tenant: Tenant, num_chars: int, refusal: list[Action]) -> list[Action]:
        """``refusal`` held back while the tenant's earlier refusals are paid for."""
        delay_s = self._refusals.delay_s(tenant.name, num_chars, self._clock())
        return refusal if delay_s < MIN_WAIT_S else [Wait(delay_s), *refusal]

    def on_submit_refused(self, request_id: str, code: ErrorCode, message: str) -> list[Action]:
        """The shell did not post the SubmitRequest (the tenant's tokens per
        minute are spent, Redis refused it): the accepted request ends in an
        ``error`` at once."""
        return self.feed.end_with_error(request_id, code, message)

    def on_gateway_message(self, data: bytes, source: str) -> list[Action]:
        """A message from the gateway's tokens channel ``source``."""
        self.table.expire()
        return self.feed.on_gateway_message(data, source)

    def on_log_entries(
        self, request_id: str, entries: Sequence[RequestLogEntry], source: str = LOG_SOURCE
    ) -> list[Action]:
        """New entries of the log ``source`` of a request (followed, or read again
        to fill what pub/sub lost while Redis was unreachable); tokens already
        here are skipped."""
        self.table.expire()
        return self.feed.on_log_entries(request_id, entries, source)

    # --- cancel and resume -----------------------------------------------------------

    def _cancel(self, socket_id: int, cancel: Cancel) -> list[Action]:
        request_id = self.table.request_on(socket_id, cancel.id)
        if request_id is None:
            return error_frames(
                socket_id,
                "invalid_request",
                f"no request with id {cancel.id!r} is in flight on this socket",
                cancel.id,
            )
        if self.table.take_pending(request_id) is not None:
            # Nothing went upstream yet: the tokenizer's result will find no one.
            usage = Usage(prompt_tokens=0, completion_tokens=0)
            done = Done(cancel.id, "cancelled", usage, Timings(ttft_ms=None, total_ms=0.0))
            return [SendFrame(socket_id, done)]
        stream = self.table.stream(request_id)
        assert stream is not None, "a request on a socket is pending or known"
        completion = stream.cancel(self._clock())
        self.table.finish(stream)
        return [cancel_upstream(stream), *stream_frames(socket_id, cancel.id, [completion])]

    def _resume(self, socket_id: int, resume: Resume) -> list[Action]:
        stream = self.table.stream(resume.request_id)
        if stream is None:
            # Maybe accepted by another gateway (one that died): its log says.
            return [LoadLog(socket_id, resume.request_id, resume)]
        if stream.tenant != self.table.socket(socket_id).tenant.name:
            # Answered exactly like an unknown id: another tenant's request never shows.
            return self._unknown_request(socket_id, resume)
        if not stream.resumable:
            return self._not_resumable(socket_id, resume)
        client_id = resume.id if resume.id is not None else stream.original_client_id
        if not stream.finished:
            refusal = self._attach(socket_id, stream, client_id)
            if refusal is not None:
                return refusal
        return stream_frames(socket_id, client_id, stream.replay(resume.after_seq))

    def _attach(self, socket_id: int, stream: RequestStream, client_id: str) -> list[Action] | None:
        """Move a live request's frames to ``socket_id`` under ``client_id``; None when done."""
        holder = self.table.request_on(socket_id, client_id)
        if holder is not None and holder != stream.request_id:
            return error_frames(
                socket_id,
                "invalid_request",
                f"a request with id {client_id!r} is already in flight on this socket",
                client_id,
            )
        route = self.table.route(stream.request_id)
        if route is None or route.socket_id != socket_id:
            try:
                # The tenant already holds it: only the socket's cap applies.
                self._admission.check_socket_room(self.table, socket_id)
            except AdmissionRefused as refused:
                return refusal_frames(socket_id, refused, client_id)
        self.table.attach(stream, Route(socket_id, client_id))
        logger.info("request_resumed", request_id=stream.request_id)
        return None

    def _not_resumable(self, socket_id: int, resume: Resume) -> list[Action]:
        return error_frames(
            socket_id,
            "invalid_request",
            f"request {resume.request_id!r} came over HTTP: its tokens go only to its "
            "HTTP response (only requests made on a websocket can be resumed)",
            resume.id,
        )

    def _unknown_request(self, socket_id: int, resume: Resume) -> list[Action]:
        return error_frames(
            socket_id,
            "invalid_request",
            f"unknown request_id {resume.request_id!r} (never accepted, or finished too long ago)",
            resume.id,
        )

    # --- request logs: a request taken over from another gateway ----------------------

    def on_log_loaded(self, socket_id: int, resume: Resume, log: RequestLog | None) -> list[Action]:
        """The log a ``LoadLog`` asked for (None: there is none): take the request
        over from the gateway that accepted it and serve the ``resume``."""
        self.table.expire()
        if not self.table.has_socket(socket_id):
            return []
        if self.table.stream(resume.request_id) is not None:
            # Meanwhile known here (two resumes raced): serve it as usual.
            return self._resume(socket_id, resume)
        tenant = self.table.socket(socket_id).tenant
        if log is None or log.record.submit.tenant != tenant.name:
            return self._unknown_request(socket_id, resume)
        if not log.record.resumable:
            return self._not_resumable(socket_id, resume)
        if log.failure is not None:
            # Ended with an error: the tokens it got after `after_seq`, then the error.
            client_id = resume.id if resume.id is not None else log.record.client_id
            replayed = self._stream_of_log(log, self._clock()).replay(resume.after_seq)
            known = known_code(log.failure.code)
            return [
                *stream_frames(socket_id, client_id, replayed),
                *error_frames(socket_id, known, log.failure.message, client_id),
            ]
        if log.ended_after is None:
            try:
                self._admission.check_socket_room(self.table, socket_id)
                self._admission.check_tenant_room(self.table, tenant)
            except AdmissionRefused as refused:
                return refusal_frames(socket_id, refused, resume.id)
        now_s = self._clock()
        stream = self._stream_of_log(log, now_s)
        if log.ended_after is not None and not stream.finished:
            stream.cancel(now_s)
        self.table.add(stream, None)
        logger.info("request_taken_over", request_id=stream.request_id)
        actions = self._resume(socket_id, resume)
        route = self.table.route(stream.request_id)
        if not stream.finished and route is not None and route.socket_id == socket_id:
            adopted = RequestAdopted(stream.request_id, self.config.gateway_id)
            actions += [
                FollowLog(stream.request_id, log.last_entry_id, log.journal_entry_id),
                PostUpstream(adopted),
            ]
        return actions

    def _stream_of_log(self, log: RequestLog, now_s: float) -> RequestStream:
        """The request's stream rebuilt from its log: its record, then its tokens."""
        record = log.record
        stream = RequestStream.of_submit(
            record.submit,
            record.client_id,
            record.stop,
            self._tokenizer,
            now_s,
            resumable=record.resumable,
        )
        for token in log.sampled_tokens():
            stream.add(token, now_s)
        return stream


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
