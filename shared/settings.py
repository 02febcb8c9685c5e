"""Settings: the one module that reads environment variables.

Everything is built once at start into frozen dataclasses and passed down.
Environment variables (each overridable by a command-line flag):

- ``ORCAPOD_CACHE_DIR``: where prepared models live (default ``~/.cache/orcapod``).
- ``ORCAPOD_MODEL``: a Hugging Face-format model directory to serve instead of
  the embedded SmolLM2.
- ``ORCAPOD_TENANTS_FILE``: the gateways' TOML file of tenants and API key
  hashes (keys may also live in Redis; with none, one open loopback tenant).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


# The most plans a worker may hold at once: a request may be in every one of
# them, so this bounds how far ahead the scheduler plans (and its extra K/V).
MAX_INFLIGHT = 8


@dataclass(frozen=True)
class ModelLocation:
    """Where the model to load is, and where prepared models are cached."""

    cache_dir: Path
    model_dir: Path

    @property
    def is_embedded(self) -> bool:
        """True when ``model_dir`` is the prepared embedded default."""
        return self.model_dir == embedded_model_dir(self.cache_dir)


def served_model_name(model_dir: Path) -> str:
    """The name ``/v1/models`` lists, requests name and metrics carry: the model directory's."""
    return Path(model_dir).name


def embedded_model_dir(cache_dir: Path) -> Path:
    """The HF-format directory ``orcapod model prepare`` writes."""
    return cache_dir / "models" / EMBEDDED_MODEL_NAME


def model_location(
    *,
    model_dir: str | None = None,
    cache_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ModelLocation:
    """Resolve flags first, then environment, then defaults."""
    env = os.environ if environ is None else environ
    cache = Path(cache_dir or env.get("ORCAPOD_CACHE_DIR") or Path.home() / ".cache" / "orcapod")
    cache = cache.expanduser()
    chosen = model_dir or env.get("ORCAPOD_MODEL")
    model = Path(chosen).expanduser() if chosen else embedded_model_dir(cache)
    return ModelLocation(cache_dir=cache, model_dir=model)


# --- the live service ---------------------------------------------------------------
#
# Each actor's command line is defined here, with the environment variable
# that stands in for each flag, so `orcapod up`, compose.yaml and a user
# starting one actor by hand all mean the same thing.

DEFAULT_PREFIX = "orcapod"
DEFAULT_LOG_RETENTION_S = 600
# Five minutes: beyond any Redis restart or failover, short of holding memory for hours.
DEFAULT_REDIS_OUTAGE_LIMIT_S = 300.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
POLICIES = ("fair", "orca", "request")


@dataclass(frozen=True)
class RedisSettings:
    """Where Redis is (``redis://[user:password@]host:port/db`` or ``rediss://`` for TLS)."""

    url: str
    prefix: str = DEFAULT_PREFIX
    # How long a request's log stays after the request ends: the window in
    # which a client may `resume` it on any gateway.
    log_retention_s: int = DEFAULT_LOG_RETENTION_S
    # Redis unreachable this long (no PING answered): the actor stops, exit
    # status 3, for its supervisor to restart (shared/redis_outage.py); 0: never.
    outage_limit_s: float = DEFAULT_REDIS_OUTAGE_LIMIT_S


@dataclass(frozen=True)
class GatewaySettings:
    """One websocket gateway."""

    redis: RedisSettings
    model: ModelLocation
    gateway_id: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_frame_bytes: int = 1 << 20
    max_requests_per_socket: int = 64
    max_tokens_limit: int = 4096
    heartbeat_s: float = 1.0
    tenants_file: Path | None = None
    # How often the tenants file (when its mtime changed) and Redis hash are re-read.
    tenants_reload_s: float = 2.0
    # On SIGTERM: how long requests in flight may take to finish before sockets close.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # A closed socket's requests keep running this long, waiting for a resume.
    detach_grace_s: float = 30.0
    # A tenant's live requests on this gateway, attached or detached.
    max_requests_per_tenant: int = 256
    # The scheduler's max_queued for a tenant whose record sets none: no
    # tenant fills the scheduler's global queue alone.
    default_max_queued: int = 256
    # Threads that tokenize prompts off the event loop. Prompts wait for them
    # in a fair queue per tenant (gateway/tokenize_queue.py): past its share of
    # characters waiting or being tokenized a tenant's generate gets queue_full;
    # so does anyone's past the gateway's caps on jobs and characters (memory).
    tokenizer_threads: int = 2
    max_tokenizing: int = 1024
    max_tokenizing_chars: int = 8_000_000
    max_tokenizing_chars_per_tenant: int = 1_000_000
    # A tenant's refused generates are answered no faster than this many
    # characters of their prompts a second (the refused socket waits), so
    # resending a refused 100,000-character prompt at once is no flood.
    max_refused_chars_per_s: float = 2_000_000.0
    # Unsent frames one socket may hold; a client that does not read is closed (1013).
    max_outbox_bytes: int = 8 << 20
    # A request with no token (and no end) this long is ended with an error.
    request_stall_timeout_s: float = 300.0
    # HTTP connections (gateway/connection_guard.py): how long one may wait
    # before a request's first byte (after connecting, or between keep-alive
    # requests), then for the rest of its headers, then for its whole body;
    # a websocket leaves these at its upgrade.
    idle_timeout_s: float = 15.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Open connections, in all and per client address (an IPv6 client's /64;
    # behind a proxy every client shares its address); 0: no cap.
    max_connections: int = 8192
    max_connections_per_address: int = 1024
    # Serve keyless clients as the open tenant even beyond loopback or with keys.
    open: bool = False
    # Origins a browser's handshake may come from, besides the gateway's own.
    allowed_origins: tuple[str, ...] = ()
    # Host names a request may name besides IP literals, localhost and this
    # machine's ("*": any); checked on a keyless gateway, or once any is given.
    allowed_hosts: tuple[str, ...] = ()


def flag_environment_default(
    name: str, default: T, parse: Callable[[str], T], environ: Mapping[str, str] | None = None
) -> T:
    """An actor flag's default: ``ORCAPOD_<NAME>`` when set, else ``default``."""
    env = os.environ if environ is None else environ
    value = env.get(f"ORCAPOD_{name.upper()}")
    return default if value is None or value == "" else parse(value)


@dataclass(frozen=True)
class SchedulerSettings:
    """The one scheduler."""

    redis: RedisSettings
    policy: str = "fair"
    max_batch_size: int = 64
    token_budget: int = 512
    max_chunk_tokens: int = 512
    # Both, on a worker group of several pipeline stages (scheduler_actor.plan_builder).
    pipeline_token_budget: int = 64
    worker_timeout_s: float = 10.0
    # A gateway silent this long: its requests nobody resumed elsewhere are cancelled.
    orphan_timeout_s: float = 60.0
    max_waiting: int = 10_000
    # Prometheus metrics at http://metrics_host:metrics_port/metrics; None: not served.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    # Automatic prefix caching, and routing a request to the worker caching
    # its longest prefix (within routing_slack requests of the least loaded).
    prefix_caching: bool = True
    cache_aware_routing: bool = True
    routing_slack: int = 8
    # The served model's name (``served_model_name``): the ``model_name``
    # label of the scheduler's metrics; the scheduler never loads the model.
    model_name: str = ""


# The worker's K/V pool (gpu_worker/kv_cache.py; docs/architecture.md, *K/V pool
# size*). By default it takes this share of the memory available once the model
# is loaded: on the CPU a tenth of the host's MemAvailable, which other workers
# and processes share; on CUDA most of the device's free memory, as vLLM's
# gpu_memory_utilization (the rest is for activations and CUDA graphs).
DEFAULT_KV_CACHE_FRACTIONS = {"cpu": 0.1, "cuda": 0.9}
# ... and never more than this many sequences of the model's full context use:
# the scheduler's default max_batch_size, its bound on requests placed on one
# worker (the worker cannot see the scheduler's flag: --kv-cache-max-sequences).
DEFAULT_KV_CACHE_MAX_SEQUENCES = SchedulerSettings.max_batch_size


def default_kv_cache_fraction(device_type: str) -> float:
    """The K/V pool's default share of available memory on a ``device_type``
    ('cpu', 'cuda')."""
    return DEFAULT_KV_CACHE_FRACTIONS["cuda" if device_type == "cuda" else "cpu"]


def check_kv_cache_fraction(fraction: float) -> float:
    """``fraction`` if it is above 0 and below 1 (all of the memory would leave
    none for the forward pass), else ValueError saying so; NaN is neither."""
    if not 0 < fraction < 1:
        raise ValueError(f"must be above 0 and below 1, got {fraction}")
    return fraction


def kv_cache_fraction_flag(text: str) -> float:
    """An argparse ``type`` for ``--kv-cache-fraction``: a usage error that says
    the range."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        return check_kv_cache_fraction(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# The worker's --weights choices (gpu_worker/quantized_linear.py packs them);
# "auto" tries the fastest one the device runs first (``candidate_formats``).
WEIGHT_FORMATS = ("auto", "float32", "float16", "int4", "q4_1", "q4_1_i16")


@dataclass(frozen=True)
class WorkerSettings:
    """One GPU worker."""

    redis: RedisSettings
    model: ModelLocation
    worker_id: str
    device: str | None = None
    dtype: str | None = None
    # How the matrices are held: 'float32' (exact), or packed for the CPU's
    # kernels, 'q4_1' (orcapod's), 'float16' (fbgemm's) or 'int4'
    # (gpu_worker/quantized_linear.py); 'auto': float16 on a CPU in float32, the
    # loaded tensors elsewhere.
    weight_format: str = "auto"
    attention_backend: str | None = None
    # The K/V pool: kv_cache_bytes exactly, else kv_cache_fraction (None: the
    # device's DEFAULT_KV_CACHE_FRACTIONS) of the memory available once the
    # model is loaded, at most kv_cache_max_sequences full-context sequences.
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    block_size: int = 16
    kv_cache_max_sequences: int = DEFAULT_KV_CACHE_MAX_SEQUENCES
    # Plans the worker may hold at once (its lookahead, 1 to MAX_INFLIGHT): with 3, the plan for
    # step n+2 may still be on its way while step n runs, so the control
    # plane's round trip (result out, the scheduler's turn, plan in) has two
    # steps to come back in, not one (bench/control_plane.py).
    max_inflight: int = 3
    heartbeat_s: float = 1.0
    cuda_graphs: bool = False
    # A lone request's decode steps through one graph compiled by torch.compile
    # on the CPU (gpu_worker/compiled_decode.py): compiled once at start.
    compile_decode: bool = True
    # Serve on the eager forward at once while the compiled paths are built, each
    # from the step after it passed its checks (gpu_worker/path_compiler.py).
    serve_while_compiling: bool = True
    # The engine in a process of its own (its own GIL), or on a thread of the
    # worker's (gpu_worker/engine_host.py).
    engine_process: bool = True
    # Prometheus metrics at http://metrics_host:metrics_port/metrics; None: not served.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    # A worker group (gpu_worker/worker_group.py): the model's layers split into
    # pipeline_parallel stages of tensor_parallel engine ranks each, over
    # torch.distributed; rank r is tensor rank r % T of stage r // T.
    # layer_split: each stage's layers (None: balanced by count). group_rank: the
    # one rank this process runs (None: every rank, on this host); rank 0 is the
    # group's only Redis client. rendezvous: HOST:PORT of rank 0's store (None:
    # a free port on 127.0.0.1, every rank here). local_ranks: the ranks on this
    # host, which share its memory (None: all of them, or 1 with group_rank).
    pipeline_parallel: int = 1
    # Ranks of each stage, its layers' heads and MLP split between them.
    tensor_parallel: int = 1
    layer_split: tuple[int, ...] | None = None
    group_rank: int | None = None
    rendezvous: str | None = None
    rendezvous_timeout_s: float = 120.0
    local_ranks: int | None = None


def redis_settings(
    url: str | None = None,
    prefix: str | None = None,
    environ: Mapping[str, str] | None = None,
    log_retention_s: int | None = None,
    outage_limit_s: float | None = None,
) -> RedisSettings:
    """Flags first, then ``REDIS_URL`` / ``ORCAPOD_PREFIX`` /
    ``ORCAPOD_LOG_RETENTION_S`` / ``ORCAPOD_REDIS_OUTAGE_LIMIT_S``, then
    localhost and the defaults."""
    env = os.environ if environ is None else environ
    retention = log_retention_s or int(env.get("ORCAPOD_LOG_RETENTION_S") or 0)
    if retention < 0:
        raise ValueError(f"the log retention must be positive, got {retention} s")
    if outage_limit_s is None:
        outage_limit_s = flag_environment_default(
            "redis_outage_limit_s", DEFAULT_REDIS_OUTAGE_LIMIT_S, float, env
        )
    if not (0 <= outage_limit_s < math.inf):
        raise ValueError(
            f"the Redis outage limit must be 0 (never stop) or a positive number of "
            f"seconds, got {outage_limit_s}"
        )
    return RedisSettings(
        url=url or env.get("REDIS_URL") or "redis://127.0.0.1:6379/0",
        prefix=prefix or env.get("ORCAPOD_PREFIX") or DEFAULT_PREFIX,
        log_retention_s=retention or DEFAULT_LOG_RETENTION_S,
        outage_limit_s=outage_limit_s,
    )


def tenants_file(flag: str | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The tenants file: the flag, else ``ORCAPOD_TENANTS_FILE``, else none."""
    env = os.environ if environ is None else environ
    chosen = flag or env.get("ORCAPOD_TENANTS_FILE")
    return Path(chosen).expanduser() if chosen else None


def redis_url_from_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """``REDIS_URL`` if set: `orcapod up` starts its own redis-server when it is not."""
    env = os.environ if environ is None else environ
    return env.get("REDIS_URL") or None


def client_api_key(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The API key a client (``orcapod chat``, ``orcapod bench``) sends: the
    flag, else ``ORCAPOD_API_KEY``; None for an open gateway."""
    env = os.environ if environ is None else environ
    return flag or env.get("ORCAPOD_API_KEY") or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The handshake headers that carry ``api_key`` (none without one)."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def default_instance_id(role: str) -> str:
    """A name for an actor instance: role, host and pid (unique on one Redis)."""
    return f"{role}-{os.uname().nodename}-{os.getpid()}"


def env_bool(value: str) -> bool:
    """A boolean from the environment: 1, true, yes or on (any case) are true."""
    return value.strip().lower() in {"1", "true", "yes", "on"}


def seconds_flag(text: str) -> float:
    """An argparse ``type``: a finite number of seconds >= 0, else a usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def int_flag(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high`` (no bound:
    None), else a usage error that says which."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"{low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above 0 (a timeout in seconds),
    else a usage error that says so."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def add_redis_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--redis-url`` and ``--prefix`` flags every actor takes."""
    parser.add_argument("--redis-url", help="default: $REDIS_URL, else redis://127.0.0.1:6379/0")
    parser.add_argument("--prefix", help="Redis key prefix (default: $ORCAPOD_PREFIX or orcapod)")
    parser.add_argument(
        "--log-retention-s",
        type=int,
        help="how long a finished request can be resumed on any gateway "
        f"(default: $ORCAPOD_LOG_RETENTION_S or {DEFAULT_LOG_RETENTION_S})",
    )
    parser.add_argument(
        "--redis-outage-limit-s",
        type=seconds_flag,
        help="stop (exit status 3, for a supervisor to restart) when Redis has not answered "
        "for this long; 0: retry forever "
        f"(default: $ORCAPOD_REDIS_OUTAGE_LIMIT_S or {DEFAULT_REDIS_OUTAGE_LIMIT_S:g})",
    )


def redis_settings_from_args(args: argparse.Namespace) -> RedisSettings:
    """RedisSettings from the flags of ``add_redis_arguments``, then the environment."""
    return redis_settings(
        url=args.redis_url,
        prefix=args.prefix,
        log_retention_s=args.log_retention_s,
        outage_limit_s=args.redis_outage_limit_s,
    )
