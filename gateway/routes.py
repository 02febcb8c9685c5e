"""What the gateway's one port answers: the aiohttp application with its
middlewares and routes (``/ws`` and ``/dashboard/ws``, ``/v1/*``, the pages
``/`` and ``/dashboard`` and their static files, ``/healthz`` and
``/health``, ``/metrics``), the pages' headers and the health check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path

import redis.asyncio as aioredis
import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from gateway.guarded_site import track_requests
from gateway.openai_endpoint import OpenAIEndpoint
from gateway.sockets import SocketHandlers
from shared.metrics_http import METRICS_PATH, metrics_handler

logger = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

WS_PATH = "/ws"
DASHBOARD_WS_PATH = "/dashboard/ws"
HEALTH_PATH = "/healthz"
# vLLM's and llama.cpp's name for the same check.
HEALTH_ALIAS_PATH = "/health"
HEALTH_TIMEOUT_S = 1.0
STATIC_DIR = Path(__file__).resolve().parent / "static"
# The pages run only their own scripts, talk only to this gateway, and are never framed.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def build_app(
    *,
    max_body_bytes: int,
    host_guard: Middleware,
    sockets: SocketHandlers,
    openai: OpenAIEndpoint,
    health: Handler,
    metrics_registry: CollectorRegistry,
) -> web.Application:
    """The gateway's application: every route, behind the connection guard's
    request tracking and the ``Host`` check (``gateway/host_guard.py``)."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[track_requests, host_guard])
    app.router.add_get(WS_PATH, sockets.websocket)
    app.router.add_get(DASHBOARD_WS_PATH, sockets.dashboard)
    app.router.add_get("/", page("chat.html"))
    app.router.add_get("/dashboard", page("dashboard.html"))
    app.router.add_static("/static", STATIC_DIR, follow_symlinks=False)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_get(HEALTH_ALIAS_PATH, health)
    app.router.add_get(METRICS_PATH, metrics_handler(metrics_registry))
    openai.add_routes(app)
    return app


def page(name: str) -> Handler:
    """A handler serving one page of ``gateway/static`` with the pages' headers.

    The page holds no data: what it shows comes over its websocket, which
    asks for the API key as every socket does."""
    path = STATIC_DIR / name

    async def serve(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(path, headers=PAGE_HEADERS)

    return serve


def health_check(redis: aioredis.Redis, ready_key: str) -> Handler:
    """``/healthz``: 200 while a worker is ready (the scheduler keeps
    ``ready_key`` alive while at least one is registered), else 503."""

    async def health(request: web.Request) -> web.StreamResponse:
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                ready = bool(await redis.exists(ready_key))
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("health_check_failed", error=str(error))
            ready = False
        if ready:
            return web.Response(text="ready\n")
        return web.Response(status=HTTPStatus.SERVICE_UNAVAILABLE, text="no worker is ready\n")

    return health
