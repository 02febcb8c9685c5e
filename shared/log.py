"""Process setup for actors: structlog, and the event loop (uvloop when installed).

structlog setup: JSON lines when not on a terminal, pretty output on one.

Call ``configure_logging(role)`` once at the start of an actor's process;
bind ``request_id`` with ``structlog.contextvars.bind_contextvars`` where a
request is handled.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog
from redis.exceptions import AuthenticationError

from shared.lifeline import watch_lifeline
from shared.redis_outage import EXIT_REDIS_GONE, RedisGoneError, stopping_when_redis_gone
from shared.settings import RedisSettings

T = TypeVar("T")


def configure_logging(role: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to ``role``."""
    renderer: structlog.typing.Processor
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer()
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # One write a line, newline included: a worker group's ranks share one
        # stderr, and a line in two writes can land inside another rank's.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logger: structlog.stdlib.BoundLogger = structlog.get_logger().bind(role=role)
    return logger


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run_actor(
    program: str, main: Coroutine[Any, Any, None], redis: RedisSettings | None = None
) -> int:
    """Run an actor's ``main`` to its end, stopping it when the launcher that
    started it is gone (``shared/lifeline.py``) or, given its ``redis``
    settings, when Redis has not answered for their ``outage_limit_s``
    (``shared/redis_outage.py``); its exit status: 0, 2 when Redis refused the
    login (no retry can help: the URL's user or password is wrong), or 3 when
    Redis was gone for good."""
    refused: BaseException | None = None
    gone: BaseException | None = None
    watch_lifeline(program)
    if redis is not None:
        main = stopping_when_redis_gone(main, redis.url, redis.outage_limit_s)
    try:
        run_event_loop(main)
    except* AuthenticationError as group:
        refused = group.exceptions[0]
    except* RedisGoneError as group:
        gone = group.exceptions[0]
    if gone is not None:
        print(f"{program}: {gone}; stopping", file=sys.stderr)
        return EXIT_REDIS_GONE
    if refused is None:
        return 0
    print(
        f"{program}: Redis refused the login ({refused}); "
        "check the user and password of REDIS_URL / --redis-url",
        file=sys.stderr,
    )
    return 2


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: an actor's graceful shutdown starts there.

    Call from inside the running event loop.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, stop.set)
    return stop
