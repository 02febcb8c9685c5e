"""``python -m gateway``: run one websocket gateway until SIGINT or SIGTERM.

SIGHUP re-reads the tenants file and hash at once. Exit status 2: a broken
tenants file, or a non-loopback ``--host`` with no API key configured.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

import structlog

from gateway.server import GatewayServer
from gateway.tenants import TenantConfigError
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.log import configure_logging, run_actor, stop_on_signals
from shared.settings import (
    GatewaySettings,
    add_redis_arguments,
    default_instance_id,
    model_location,
    redis_settings,
    redis_settings_from_args,
    tenants_file,
)

DEFAULTS = GatewaySettings(redis=redis_settings(), model=model_location(), gateway_id="")


def parse_settings(argv: Sequence[str] | None = None) -> GatewaySettings:
    """Settings from flags, then the environment (via shared.settings), then defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway", description="orcapod's websocket gateway"
    )
    parser.add_argument("--host", default=DEFAULTS.host)
    parser.add_argument("--port", type=int, default=DEFAULTS.port, help="0 picks a free port")
    parser.add_argument("--gateway-id", help="unique per Redis (default: gateway-HOST-PID)")
    add_redis_arguments(parser)
    parser.add_argument("--model", help="Hugging Face-format model directory (default: embedded)")
    parser.add_argument("--max-frame-bytes", type=int, default=DEFAULTS.max_frame_bytes)
    parser.add_argument(
        "--max-requests-per-socket", type=int, default=DEFAULTS.max_requests_per_socket
    )
    parser.add_argument("--max-tokens-limit", type=int, default=DEFAULTS.max_tokens_limit)
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DEFAULTS.drain_timeout_s,
        help="on SIGTERM, how long requests in flight may take to finish",
    )
    parser.add_argument(
        "--detach-grace-s",
        type=float,
        default=DEFAULTS.detach_grace_s,
        help="how long the requests of a closed socket keep running, waiting for a "
        "`resume` (0: cancel them at once)",
    )
    parser.add_argument(
        "--tenants-file",
        help="TOML file of tenants and API key hashes (default: $ORCAPOD_TENANTS_FILE); "
        "keys may also be in Redis; with none, the gateway is open and loopback only",
    )
    args = parser.parse_args(argv)
    return GatewaySettings(
        redis=redis_settings_from_args(args),
        model=model_location(model_dir=args.model),
        gateway_id=args.gateway_id or default_instance_id("gateway"),
        host=args.host,
        port=args.port,
        max_frame_bytes=args.max_frame_bytes,
        max_requests_per_socket=args.max_requests_per_socket,
        max_tokens_limit=args.max_tokens_limit,
        drain_timeout_s=args.drain_timeout_s,
        detach_grace_s=args.detach_grace_s,
        tenants_file=tenants_file(args.tenants_file),
    )


async def serve_until_signalled(settings: GatewaySettings) -> None:
    """Load the tokenizer, then serve until SIGINT or SIGTERM asks for a graceful stop."""
    tokenizer = ChatTokenizer.from_model_dir(settings.model.model_dir)
    limits = ModelLimits.from_model_dir(
        settings.model.model_dir, tokenizer.vocab_size, settings.max_tokens_limit
    )
    stop = stop_on_signals()
    server = GatewayServer(settings, tokenizer, limits)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, server.request_tenants_reload)
    await server.run(stop)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    settings = parse_settings(argv)
    logger = configure_logging("gateway")
    # Every module's logger then names the actor, not just this one.
    structlog.contextvars.bind_contextvars(role="gateway", gateway_id=settings.gateway_id)
    # Host and port only: the URL may hold a password.
    redis_address = urlsplit(settings.redis.url)
    logger.info(
        "starting gateway",
        redis=f"{redis_address.hostname}:{redis_address.port}",
    )
    try:
        return run_actor("python -m gateway", serve_until_signalled(settings))
    except TenantConfigError as error:
        print(f"python -m gateway: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
