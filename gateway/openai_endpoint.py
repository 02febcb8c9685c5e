"""The OpenAI-compatible HTTP API of a gateway: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /v1/models/{model}``.

A thin shell. Each request is one virtual socket of the same
:class:`gateway.session.GatewaySession` that serves the websockets, so keys,
tenants, quotas, fairness, limits and durability are decided in one place:
the body becomes a ``generate`` (``gateway/openai_api.py``), the core admits
and answers it with frames, and :class:`Exchange` turns those frames into
the response, JSON or server-sent events through a bounded
:class:`gateway.outbox.Outbox`. A client that goes away (aiohttp cancels its
handler) cancels its request at once: HTTP has no ``resume``. Every error
response it sends is counted in the gateway's metrics, once: the core's
refusals as the frames they came in, the rest here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Protocol

import structlog
from aiohttp import web

from gateway.actions import Action, ServerFrame
from gateway.handshake import Admitted, HandshakeRefused
from gateway.metrics import GatewayMetrics
from gateway.openai_api import (
    OpenAIError,
    ParsedRequest,
    Reply,
    error_of_frame,
    model_body,
    model_not_found,
    models_body,
    parse_chat,
    parse_completion,
    unauthorized,
)
from gateway.outbox import Outbox
from gateway.session import GatewaySession
from shared.protocol import Accepted, Done, Error, Token

logger = structlog.get_logger(__name__)

API_PREFIX = "/v1/"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
# A model id may hold a `/` (`HuggingFaceTB/SmolLM2-135M-Instruct`), sent as
# it is or as `%2F` (the `openai` client's way).
MODEL_PATH = MODELS_PATH + "/{model:.+}"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Proxies (nginx) must pass each event on at once.
    "X-Accel-Buffering": "no",
}


class ExchangeHost(Protocol):
    """What the endpoint needs of the gateway's shell."""

    @property
    def session(self) -> GatewaySession: ...

    @property
    def draining(self) -> bool: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    def admit(self, request: web.Request) -> Admitted:
        """Who the request is (raises HandshakeRefused: 401, 403)."""
        ...

    def open_exchange(self, admitted: Admitted, exchange: Exchange) -> int:
        """A virtual socket for one request; its frames go to ``exchange``."""
        ...

    async def close_exchange(self, socket_id: int) -> None:
        """The request's response is over (or its client gone): cancel what still runs."""
        ...

    async def apply(self, actions: list[Action]) -> None: ...


class Exchange:
    """One OpenAI request's frames, turned into its response as they come.

    Until the first token (or the end) nothing is answered, so a refusal
    (a bad prompt, a full queue) is a plain HTTP error with its status; after
    it, a stream's error is an ``error`` event. ``num_prompt_tokens_of`` gives
    an accepted request's prompt length; ``count_error`` counts an error that
    came in no frame (:meth:`end_with`).
    """

    def __init__(
        self,
        parsed: ParsedRequest,
        served_model: str,
        max_outbox_bytes: int,
        num_prompt_tokens_of: Callable[[str], int],
        count_error: Callable[[OpenAIError], None],
    ) -> None:
        self.parsed = parsed
        self._served_model = served_model
        self._num_prompt_tokens_of = num_prompt_tokens_of
        self._count_error = count_error
        self.outbox = Outbox(max_outbox_bytes)
        self._reply: Reply | None = None
        # Set on the first token, the end or an error: the response can begin.
        self.started = asyncio.Event()
        # Set at the end (a non-streaming body, or an error).
        self.finished = asyncio.Event()
        self.refusal: OpenAIError | None = None
        self.body: bytes | None = None

    def put(self, frame: ServerFrame) -> bool:
        """A frame the core sent; False when the outbox went over its cap."""
        if isinstance(frame, Accepted):
            num_prompt_tokens = self._num_prompt_tokens_of(frame.request_id)
            self._reply = Reply(
                self.parsed,
                self._served_model,
                frame.request_id,
                num_prompt_tokens=num_prompt_tokens,
            )
            return True
        if self.finished.is_set():
            return True
        if isinstance(frame, Error):
            return self._error(error_of_frame(frame))
        if self._reply is None:  # never before `accepted`; named all the same
            self._reply = Reply(self.parsed, self._served_model, "unaccepted", num_prompt_tokens=0)
        reply = self._reply
        if isinstance(frame, Token):
            # `seq` counts the request's tokens from 0.
            data = reply.token(frame.text, frame.seq + 1)
            if self.parsed.stream and not self.started.is_set():
                data = reply.head() + data
        else:
            assert isinstance(frame, Done)
            data = reply.done(frame)
            if not self.parsed.stream:
                self.body = data
                data = b""
            self.finished.set()
        self.started.set()
        fits = not data or self.outbox.put(data)
        if self.finished.is_set():
            self.outbox.close()
        return fits

    def end_with(self, error: OpenAIError) -> None:
        """End the response now with ``error`` (once streaming: an error event,
        then ``[DONE]``); what the core sends later is dropped."""
        if not self.finished.is_set():
            self._count_error(error)
            self._error(error)

    def _error(self, error: OpenAIError) -> bool:
        fits = True
        if self.parsed.stream and self.started.is_set() and self._reply is not None:
            fits = self.outbox.put(self._reply.stream_error(error))
        else:
            self.refusal = error
        self.started.set()
        self.finished.set()
        self.outbox.close()
        return fits


class OpenAIEndpoint:
    """The routes of the OpenAI API on one gateway's aiohttp application."""

    def __init__(
        self,
        host: ExchangeHost,
        served_model: str,
        context_tokens: int,
        max_body_bytes: int,
        max_outbox_bytes: int,
        on_started: Callable[[], None],
        on_ended: Callable[[int | None, bool], None],
    ) -> None:
        self._host = host
        self.served_model = served_model
        self._context_tokens = context_tokens
        self._max_body_bytes = max_body_bytes
        self._max_outbox_bytes = max_outbox_bytes
        self._on_started = on_started
        self._on_ended = on_ended
        self._created = int(time.time())

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(CHAT_PATH, self.chat_completions)
        app.router.add_post(COMPLETIONS_PATH, self.completions)
        app.router.add_get(MODELS_PATH, self.models)
        app.router.add_get(MODEL_PATH, self.model)
        app.middlewares.append(self.openai_shaped_http_errors)

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            self._admit(request)
        except OpenAIError as error:
            return self._refuse(error)
        body = models_body(self.served_model, self._context_tokens, self._created)
        return web.Response(body=body, content_type="application/json")

    async def model(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models/{model}`` (the ``openai`` client's ``models.retrieve``)."""
        try:
            self._admit(request)
            requested = request.match_info["model"]
            if requested != self.served_model:
                raise model_not_found(requested, self.served_model, None)
        except OpenAIError as error:
            return self._refuse(error)
        body = model_body(self.served_model, self._context_tokens, self._created)
        return web.Response(body=body, content_type="application/json")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def _generate(
        self, request: web.Request, parse: Callable[[bytes, str], ParsedRequest]
    ) -> web.StreamResponse:
        self._on_started()
        socket_id: int | None = None
        exchange: Exchange | None = None
        try:
            admitted = self._admit(request)
            if self._host.draining:
                raise shutting_down()
            require_json(request)
            parsed = parse(await self._read_body(request), self.served_model)
            exchange = Exchange(
                parsed,
                self.served_model,
                self._max_outbox_bytes,
                self._num_prompt_tokens,
                self._count_error,
            )
            socket_id = self._host.open_exchange(admitted, exchange)
            await self._host.apply(self._host.session.on_generate(socket_id, parsed.generate))
            await exchange.started.wait()
            if not parsed.stream:
                await exchange.finished.wait()
            if exchange.refusal is not None:
                # Counted as the frame it came in (or by `end_with`).
                return error_response(exchange.refusal)
            if not parsed.stream:
                assert exchange.body is not None
                return web.Response(body=exchange.body, content_type="application/json")
            return await self._stream(request, exchange)
        except OpenAIError as error:
            return self._refuse(error)
        finally:
            if socket_id is not None:
                await self._host.close_exchange(socket_id)
            # A request its client left before the end was aborted (and cancelled).
            self._on_ended(socket_id, exchange is not None and not exchange.finished.is_set())

    async def _stream(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        response = web.StreamResponse(status=HTTPStatus.OK, headers=SSE_HEADERS)
        await response.prepare(request)

        async def abort() -> None:
            # A client that stopped reading: nothing it has not read is kept.
            logger.warning("SSE client too slow, closing", max_bytes=self._max_outbox_bytes)
            if request.transport is not None:
                request.transport.abort()

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(exchange.outbox.write_to(response.write))
            tasks.create_task(exchange.outbox.close_on_overflow(abort))
        if not exchange.outbox.overflowed:
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
        return response

    @web.middleware
    async def openai_shaped_http_errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Under ``/v1``, aiohttp's own refusals (no such route, a wrong method)
        in OpenAI's shape too, so every client there parses every error."""
        try:
            return await handler(request)
        except web.HTTPException as refused:
            if not request.path.startswith(API_PREFIX) or refused.status < 400:
                raise
            status = HTTPStatus(refused.status)
            message = f"{request.method} {request.path}: {status.phrase.lower()}"
            return self._refuse(OpenAIError(status, message))

    def _refuse(self, error: OpenAIError) -> web.Response:
        """The response to a request refused here, before the core saw it."""
        self._count_error(error)
        return error_response(error)

    def _count_error(self, error: OpenAIError) -> None:
        self._host.metrics.count_error(error.metric_code)

    def _num_prompt_tokens(self, request_id: str) -> int:
        # The session adds a request's stream before it sends its `accepted`.
        stream = self._host.session.stream(request_id)
        assert stream is not None, request_id
        return stream.num_prompt_tokens

    def _admit(self, request: web.Request) -> Admitted:
        try:
            return self._host.admit(request)
        except HandshakeRefused as refused:
            message = refused.body.strip()
            if refused.status == HTTPStatus.UNAUTHORIZED:
                raise unauthorized(message) from refused
            if refused.status == HTTPStatus.BAD_REQUEST:
                raise OpenAIError(refused.status, message) from refused
            raise OpenAIError(refused.status, message, type="permission_error") from refused

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self._max_body_bytes:
            raise _too_large(self._max_body_bytes)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as error:
            raise _too_large(self._max_body_bytes) from error


def shutting_down() -> OpenAIError:
    """The gateway is draining: a new request is refused, one still running ends."""
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "the gateway is shutting down; try another one",
        type="server_error",
        code="service_unavailable",
    )


def require_json(request: web.Request) -> None:
    """Raise OpenAIError (415) unless the body is declared JSON.

    A page of any site may POST ``text/plain`` (or a form, or an untyped
    blob) anywhere without asking first; ``application/json`` makes a browser
    ask (a CORS preflight, which this gateway never grants)."""
    if request.content_type != "application/json":
        declared = request.headers.get("Content-Type")
        raise OpenAIError(
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            "the request body must be JSON sent as Content-Type: application/json "
            f"(got {'none' if declared is None else repr(declared)})",
            code="unsupported_media_type",
        )


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"the request body is over the limit of {limit} bytes",
        code="request_too_large",
    )


def error_response(error: OpenAIError) -> web.Response:
    """OpenAI's error object with its HTTP status (a 401 names the scheme)."""
    headers = {}
    if error.status == HTTPStatus.UNAUTHORIZED:
        headers["WWW-Authenticate"] = 'Bearer realm="orcapod"'
    return web.Response(
        status=error.status, body=error.body(), content_type="application/json", headers=headers
    )
