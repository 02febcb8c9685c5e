"""Serving one actor's Prometheus registry at ``GET /metrics`` over aiohttp.

Each actor keeps its own ``CollectorRegistry`` and serves it itself (no
multiprocess mode): the scheduler and the workers on their ``--metrics-port``
(``serve_metrics``, an owned task), the gateway on its own app
(``metrics_handler``). What each metric means: ``docs/metrics.md``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

METRICS_PATH = "/metrics"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_log = structlog.get_logger(__name__)


def metrics_handler(registry: CollectorRegistry) -> Handler:
    """An aiohttp handler answering with ``registry`` in the text format.

    The format follows the scrape's ``Accept`` header as prometheus_client's own
    exporters do (``choose_encoder``: ``generate_latest`` with
    ``CONTENT_TYPE_LATEST``, or OpenMetrics when asked for); a plain ``GET``
    gets the classic 0.0.4 text format. Collecting runs on the event loop, so a
    collector reads its actor's state between two of the actor's awaits.
    """

    async def handle(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(registry), headers={"Content-Type": content_type})

    return handle


def metrics_url(host: str, port: int) -> str:
    """``http://host:port/metrics`` (an IPv6 host in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{METRICS_PATH}"


async def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    stop: asyncio.Event,
    listening: Callable[[int], None] | None = None,
) -> None:
    """Serve ``registry`` at ``http://host:port/metrics`` until ``stop`` is set.

    ``port`` 0 binds any free port; ``listening`` is called with the bound port
    once the socket accepts connections. A port that cannot be bound raises
    (``OSError``): asked-for metrics that never appear would go unnoticed.
    """
    app = web.Application()
    app.router.add_get(METRICS_PATH, metrics_handler(registry))
    # No access log: a scrape every few seconds is not news.
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
        _log.info("metrics_serving", url=metrics_url(host, bound_port))
        if listening is not None:
            listening(bound_port)
        await stop.wait()
    finally:
        await runner.cleanup()


async def run_with_metrics(
    main: Awaitable[None], registry: CollectorRegistry, host: str, port: int | None
) -> None:
    """Await an actor's ``main``, serving ``registry`` beside it when ``port``
    is not None: both tasks in one TaskGroup, the server up until ``main`` is
    done (so it answers while the actor drains), and either's error ends both."""
    if port is None:
        await main
        return
    done = asyncio.Event()

    async def main_then_done() -> None:
        try:
            await main
        finally:
            done.set()

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(serve_metrics(registry, host, port, done))
        tasks.create_task(main_then_done())
