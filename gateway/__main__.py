"""``python -m gateway``: run one gateway (the websocket protocol and the OpenAI
API on one port) until SIGINT or SIGTERM.

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
    env_bool,
    flag_environment_default,
    model_location,
    redis_settings,
    redis_settings_from_args,
    tenants_file,
)

DEFAULTS = GatewaySettings(redis=redis_settings(), model=model_location(), gateway_id="")


def parse_settings(argv: Sequence[str] | None = None) -> GatewaySettings:
    """Settings from flags, then the environment (via shared.settings), then defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="orcapod's gateway: the websocket protocol and the OpenAI API on one port",
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
    env = flag_environment_default
    parser.add_argument(
        "--max-requests-per-tenant",
        type=int,
        default=env("max_requests_per_tenant", DEFAULTS.max_requests_per_tenant, int),
        help="a tenant's live requests on this gateway, attached or detached "
        "($ORCAPOD_MAX_REQUESTS_PER_TENANT)",
    )
    parser.add_argument(
        "--default-max-queued",
        type=int,
        default=env("default_max_queued", DEFAULTS.default_max_queued, int),
        help="max_queued of a tenant whose record sets none ($ORCAPOD_DEFAULT_MAX_QUEUED)",
    )
    parser.add_argument(
        "--tokenizer-threads",
        type=int,
        default=env("tokenizer_threads", DEFAULTS.tokenizer_threads, int),
        help="threads that tokenize prompts off the event loop ($ORCAPOD_TOKENIZER_THREADS)",
    )
    parser.add_argument(
        "--max-tokenizing",
        type=int,
        default=env("max_tokenizing", DEFAULTS.max_tokenizing, int),
        help="requests that may wait for the tokenizer threads; more get queue_full "
        "($ORCAPOD_MAX_TOKENIZING)",
    )
    parser.add_argument(
        "--max-outbox-bytes",
        type=int,
        default=env("max_outbox_bytes", DEFAULTS.max_outbox_bytes, int),
        help="unsent frames one socket may hold before it is closed (1013) "
        "($ORCAPOD_MAX_OUTBOX_BYTES)",
    )
    parser.add_argument(
        "--request-stall-timeout-s",
        type=float,
        default=env("request_stall_timeout_s", DEFAULTS.request_stall_timeout_s, float),
        help="a request with no token for this long ends in an error "
        "($ORCAPOD_REQUEST_STALL_TIMEOUT_S)",
    )
    parser.add_argument(
        "--open",
        action="store_true",
        default=env("open", DEFAULTS.open, env_bool),
        help="serve clients without a key as the open tenant, even beyond loopback or "
        "with keys configured ($ORCAPOD_OPEN)",
    )
    parser.add_argument(
        "--allowed-origin",
        action="append",
        dest="allowed_origins",
        help="an Origin a browser's handshake may come from, e.g. https://chat.example "
        "(repeatable; default: the Host it connects to; $ORCAPOD_ALLOWED_ORIGINS, "
        "comma-separated)",
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
        max_requests_per_tenant=args.max_requests_per_tenant,
        default_max_queued=args.default_max_queued,
        tokenizer_threads=args.tokenizer_threads,
        max_tokenizing=args.max_tokenizing,
        max_outbox_bytes=args.max_outbox_bytes,
        request_stall_timeout_s=args.request_stall_timeout_s,
        open=args.open,
        allowed_origins=tuple(
            args.allowed_origins or env("allowed_origins", DEFAULTS.allowed_origins, _origins)
        ),
    )


def _origins(value: str) -> tuple[str, ...]:
    return tuple(origin.strip() for origin in value.split(",") if origin.strip())


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
