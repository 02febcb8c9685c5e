"""The OpenAI-compatible HTTP API of a gateway: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /v1/models/{model}``.

A thin shell: the body is parsed (``gateway/openai_api.py``), then the
request goes to the gateway through one call, ``open_exchange``: a virtual
socket of the session that serves the websockets, whose frames make the
response (``gateway/openai_exchange.py``). A client that goes away (aiohttp
cancels its handler) cancels its request at once: HTTP has no ``resume``.
Every error response it sends is counted once (``count_error``): the core's
refusals as the frames they came in, the rest here. See
``docs/architecture.md`` (*The OpenAI API*).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from http import HTTPStatus

import structlog
from aiohttp import web

from gateway.handshake import Admitted, HandshakeRefused
from gateway.openai_api import parse_chat, parse_completion
from gateway.openai_errors import OpenAIError, model_not_found, unauthorized
from gateway.openai_exchange import Exchange
from gateway.openai_reply import model_body, models_body
from gateway.openai_types import ParsedRequest

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

# Who a request is (raises HandshakeRefused: 400, 401, 403).
Admit = Callable[[web.Request], Admitted]
# The request's virtual socket, open while the response is made: its
# `generate` checked and admitted as a frame's, its frames into the exchange;
# on exit, what still runs is cancelled.
OpenExchange = Callable[[Admitted, Exchange], AbstractAsyncContextManager[object]]


class OpenAIEndpoint:
    """The routes of the OpenAI API on one gateway's aiohttp application."""

    def __init__(
        self,
        *,
        admit: Admit,
        open_exchange: OpenExchange,
        served_model: str,
        context_tokens: int,
        max_body_bytes: int,
        max_outbox_bytes: int,
        count_error: Callable[[str], None],
        on_started: Callable[[], None],
        on_ended: Callable[[bool], None],
    ) -> None:
        """``count_error`` counts an error response by its metric code;
        ``on_started`` and ``on_ended`` (aborted: its client left before the
        end) frame each generating request."""
        self._admit_request = admit
        self._open_exchange = open_exchange
        self.served_model = served_model
        self._context_tokens = context_tokens
        self._max_body_bytes = max_body_bytes
        self._max_outbox_bytes = max_outbox_bytes
        self._count_error_code = count_error
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
        exchange: Exchange | None = None
        try:
            admitted = self._admit(request)
            require_json(request)
            parsed = parse(await self._read_body(request), self.served_model)
            exchange = Exchange(
                parsed, self.served_model, self._max_outbox_bytes, self._count_error
            )
            async with self._open_exchange(admitted, exchange):
                return await self._respond(request, exchange)
        except OpenAIError as error:
            return self._refuse(error)
        finally:
            # A request its client left before the end was aborted (and cancelled).
            self._on_ended(exchange is not None and not exchange.finished.is_set())

    async def _respond(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        """The response, once the exchange can begin it."""
        await exchange.started.wait()
        if not exchange.parsed.stream:
            await exchange.finished.wait()
        if exchange.refusal is not None:
            # Counted as the frame it came in (or by `end_with`).
            return error_response(exchange.refusal)
        if not exchange.parsed.stream:
            assert exchange.body is not None
            return web.Response(body=exchange.body, content_type="application/json")
        return await self._stream(request, exchange)

    async def _stream(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        response = web.StreamResponse(status=HTTPStatus.OK, headers=SSE_HEADERS)
        await response.prepare(request)

        async def abort() -> None:
            # A client that stopped reading: nothing it has not read is kept.
            logger.warning("sse_client_too_slow", max_bytes=self._max_outbox_bytes)
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
        self._count_error_code(error.metric_code)

    def _admit(self, request: web.Request) -> Admitted:
        try:
            return self._admit_request(request)
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
