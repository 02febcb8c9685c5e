"""The ``Host`` check on every request the gateway answers (pages, ``/ws``,
``/v1``, ``/metrics``): the aiohttp middleware around
``gateway/handshake.py``'s ``check_host``.

When it applies is decided here: on a gateway that serves keyless clients
(the open tenant: nothing but the network stands between a page and the
model), and on any gateway given ``--allowed-host``. A gateway whose every
client needs a key answers any name by default: a rebound page has no key,
and its clients (a load balancer, Prometheus in a compose network) reach it
by names nobody listed.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from websockets.datastructures import Headers

from gateway.handshake import HandshakeRefused, check_host, single_header
from gateway.openai_endpoint import API_PREFIX, error_response
from gateway.openai_errors import OpenAIError


def own_names(bound_host: str) -> tuple[str, ...]:
    """The names this gateway answers to without being told: the one it is
    bound to (when a name) and this machine's."""
    return (bound_host, socket.gethostname())


def host_guard(
    applies: Callable[[], bool], names: Collection[str], allowed: Collection[str]
) -> Middleware:
    """A middleware refusing (403; 400 for a repeated ``Host``) a request whose
    ``Host`` is none of ``names`` or ``allowed`` while ``applies()`` (asked
    per request: the open tenant is decided once Redis answers)."""
    checked = bool(allowed)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if checked or applies():
            try:
                host = single_header(Headers(list(request.headers.items())), "Host")
                check_host(host, names, allowed)
            except HandshakeRefused as refused:
                return _refusal(request, refused)
        return await handler(request)

    return guard


def _refusal(request: web.Request, refused: HandshakeRefused) -> web.Response:
    message = refused.body.strip()
    if request.path.startswith(API_PREFIX):
        error_type = "invalid_request_error" if refused.status == 400 else "permission_error"
        return error_response(OpenAIError(refused.status, message, type=error_type))
    return web.Response(status=refused.status, text=refused.body)
