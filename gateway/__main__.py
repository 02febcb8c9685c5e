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

from gateway.http_log import quiet_malformed_requests
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
    int_flag,
    model_location,
    positive_float,
    redis_settings,
    redis_settings_from_args,
    tenants_file,
)

DEFAULTS = GatewaySettings(redis=redis_settings(), model=model_location(), gateway_id="")


def build_parser() -> argparse.ArgumentParser:
    """The gateway's command line, its defaults read from the environment now
    (``docs/configuration.md`` is made from it)."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="orcapod's gateway: the websocket protocol and the OpenAI API on one port",
    )
    parser.add_argument(
        "--host",
        default=DEFAULTS.host,
        help="address to listen on; beyond loopback only with API keys configured, or --open",
    )
    parser.add_argument("--port", type=int, default=DEFAULTS.port, help="0 picks a free port")
    parser.add_argument("--gateway-id", help="unique per Redis (default: gateway-HOST-PID)")
    add_redis_arguments(parser)
    parser.add_argument(
        "--model",
        help="Hugging Face-format model directory, for its tokenizer, chat template and "
        "context (default: $ORCAPOD_MODEL, else the embedded one)",
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        default=DEFAULTS.max_frame_bytes,
        help="largest websocket frame (larger: the socket closes with 1009) and HTTP "
        "request body (larger: 413)",
    )
    parser.add_argument(
        "--max-requests-per-socket",
        type=int,
        default=DEFAULTS.max_requests_per_socket,
        help="requests in flight on one websocket; more get queue_full",
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=int,
        default=DEFAULTS.max_tokens_limit,
        help="the largest max_tokens a request may ask for, and what a null max_tokens "
        "comes to at most",
    )
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
        help="requests that may wait for (or be on) the tokenizer threads, all tenants "
        "together; more get queue_full ($ORCAPOD_MAX_TOKENIZING)",
    )
    parser.add_argument(
        "--max-tokenizing-chars",
        type=int,
        default=env("max_tokenizing_chars", DEFAULTS.max_tokenizing_chars, int),
        help="prompt characters that may wait for (or be on) the tokenizer threads, all "
        "tenants together: the memory they hold; more get queue_full "
        "($ORCAPOD_MAX_TOKENIZING_CHARS)",
    )
    parser.add_argument(
        "--max-tokenizing-chars-per-tenant",
        type=int,
        default=env(
            "max_tokenizing_chars_per_tenant", DEFAULTS.max_tokenizing_chars_per_tenant, int
        ),
        help="a tenant's share of the tokenizer queue, in prompt characters; past it that "
        "tenant's requests get queue_full, others' are not held up "
        "($ORCAPOD_MAX_TOKENIZING_CHARS_PER_TENANT)",
    )
    parser.add_argument(
        "--max-refused-chars-per-s",
        type=float,
        default=env("max_refused_chars_per_s", DEFAULTS.max_refused_chars_per_s, float),
        help="a tenant's refused requests are answered no faster than this many characters "
        "of their prompts a second; the refused socket waits for its turn "
        "($ORCAPOD_MAX_REFUSED_CHARS_PER_S)",
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
    # The connection flags' defaults are strings, so argparse checks a value
    # from the environment as it checks one given on the command line.
    parser.add_argument(
        "--idle-timeout-s",
        type=positive_float,
        default=env("idle_timeout_s", str(DEFAULTS.idle_timeout_s), str),
        help="an HTTP connection that sends no request this long after connecting, or "
        "after its last answer (keep-alive), is closed ($ORCAPOD_IDLE_TIMEOUT_S)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=positive_float,
        default=env("header_timeout_s", str(DEFAULTS.header_timeout_s), str),
        help="how long a request's headers may take to arrive, from its first byte "
        "($ORCAPOD_HEADER_TIMEOUT_S)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=positive_float,
        default=env("body_timeout_s", str(DEFAULTS.body_timeout_s), str),
        help="how long a request's body may take to arrive, once its headers are in; "
        "websockets are not held to these timeouts ($ORCAPOD_BODY_TIMEOUT_S)",
    )
    parser.add_argument(
        "--max-connections",
        type=int_flag(0),
        default=env("max_connections", str(DEFAULTS.max_connections), str),
        help="open connections (HTTP and websocket); more are answered 503 and closed "
        "(0: no cap; keep it below ulimit -n) ($ORCAPOD_MAX_CONNECTIONS)",
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=int_flag(0),
        default=env("max_connections_per_address", str(DEFAULTS.max_connections_per_address), str),
        help="open connections from one client address (an IPv6 client's /64); behind a "
        "reverse proxy or load balancer all clients share its address: raise this or "
        "pass 0 (no cap) ($ORCAPOD_MAX_CONNECTIONS_PER_ADDRESS)",
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
        help="an Origin a browser's handshake may come from besides the gateway's own, "
        "e.g. https://chat.example (repeatable; $ORCAPOD_ALLOWED_ORIGINS, comma-separated)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        help="a name clients reach this gateway by, e.g. llm.example (repeatable; '*': any). "
        "IP addresses, localhost and this machine's name always pass; the Host header is "
        "checked on a keyless gateway, and on any once this is given "
        "($ORCAPOD_ALLOWED_HOSTS, comma-separated)",
    )
    parser.add_argument(
        "--tenants-file",
        help="TOML file of tenants and API key hashes (default: $ORCAPOD_TENANTS_FILE); "
        "keys may also be in Redis; with none, the gateway is open and loopback only",
    )
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> GatewaySettings:
    """Settings from flags, then the environment (via shared.settings), then defaults."""
    args = build_parser().parse_args(argv)
    env = flag_environment_default
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
        max_tokenizing_chars=args.max_tokenizing_chars,
        max_tokenizing_chars_per_tenant=args.max_tokenizing_chars_per_tenant,
        max_refused_chars_per_s=args.max_refused_chars_per_s,
        max_outbox_bytes=args.max_outbox_bytes,
        request_stall_timeout_s=args.request_stall_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        open=args.open,
        allowed_origins=tuple(
            args.allowed_origins or env("allowed_origins", DEFAULTS.allowed_origins, _comma_list)
        ),
        allowed_hosts=tuple(
            args.allowed_hosts or env("allowed_hosts", DEFAULTS.allowed_hosts, _comma_list)
        ),
    )


def _comma_list(value: str) -> tuple[str, ...]:
    """A comma-separated list (of origins, of host names)."""
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
    quiet_malformed_requests()
    # Every module's logger then names the actor, not just this one.
    structlog.contextvars.bind_contextvars(role="gateway", gateway_id=settings.gateway_id)
    # Host and port only: the URL may hold a password.
    redis_address = urlsplit(settings.redis.url)
    logger.info(
        "gateway_starting",
        redis=f"{redis_address.hostname}:{redis_address.port}",
    )
    try:
        return run_actor("python -m gateway", serve_until_signalled(settings), settings.redis)
    except TenantConfigError as error:
        print(f"python -m gateway: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
