"""``orcapod up``: the whole service on one machine.

Starts (when ``REDIS_URL`` is unset) an embedded redis-server, then the
scheduler, N workers and M gateways, each as its own process whose command
line names its role (``python -m gpu_worker --worker-id worker-0``); gateway
i listens on port + i; the scheduler and each worker serve Prometheus metrics
on a free loopback port (a gateway on its own port). Prints the URLs once a
gateway reports healthy.
Ctrl-C, SIGTERM or SIGHUP stops everything in order and leaves no process
and no data folder behind (a folder left by a killed launcher goes at the next
start). A scheduler, worker, gateway or embedded redis-server that exits on its
own is started again under the same name (``RestartPolicy``: 0.5 s doubling to
10 s, reset after 60 s of running), redis-server on the same port, password
and data (its append-only file); a child restarted more than 5 times within
60 s, or a redis-server that cannot come back on its port, stops the service.
Without any API key (a tenants file, or keys in an external Redis) the
gateways serve one open tenant, so they may listen on loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

import redis
from redis.exceptions import RedisError

from gateway.tenants import (
    TenantConfigError,
    UnprotectedHostError,
    is_loopback_host,
    parse_tenants_toml,
)
from orcapod.embedded_redis import (
    DEFAULT_MAXMEMORY,
    EmbeddedRedis,
    EmbeddedRedisError,
    free_loopback_port,
    remove_data,
    remove_stale_data_dirs,
    restart_embedded_redis,
    start_embedded_redis,
)
from orcapod.processes import (
    Child,
    CrashLoopError,
    RestartBackoff,
    RestartPolicy,
    environment_with,
    python_module,
    restart_child,
    restart_exited,
    start_child,
    stop_children,
    stop_together,
)
from shared.keys import RedisKeys
from shared.metrics_http import metrics_url
from shared.settings import (
    DEFAULT_DRAIN_TIMEOUT_S,
    POLICIES,
    model_location,
    redis_settings,
    redis_url_from_environment,
    tenants_file,
)

# A worker's first start on a 2-core CPU compiles its decode graphs (about three
# minutes on a Xeon, more on slower cores; a few seconds once cached).
READY_TIMEOUT_S = 600.0
GATEWAY_STOP_MARGIN_S = 5.0
RESTART_POLICY = RestartPolicy()


def build_parser() -> argparse.ArgumentParser:
    """``orcapod up``'s command line (``docs/configuration.md`` is made from it)."""
    parser = argparse.ArgumentParser(prog="orcapod up", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="gateways bind here (beyond loopback only with API keys configured)",
    )
    parser.add_argument(
        "--tenants-file",
        default=None,
        help="TOML file of tenants and API key hashes (default: $ORCAPOD_TENANTS_FILE)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port of gateway 0 (i: port + i)")
    parser.add_argument(
        "--policy", choices=POLICIES, default="fair", help="the scheduler's --policy"
    )
    parser.add_argument("--workers", type=int, default=1, help="worker processes (>= 1)")
    parser.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        help="pipeline stages of each worker: a worker group of that many engine ranks on "
        "this host, the model's layers split between them (python -m gpu_worker "
        "--pipeline-parallel; default: 1, the whole model in one engine)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="engine ranks of each stage of each worker, its layers' heads and MLP split "
        "between them (python -m gpu_worker --tensor-parallel; default: 1)",
    )
    parser.add_argument(
        "--gateways", type=int, default=1, help="gateway processes (>= 1), on consecutive ports"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="HF-format model dir, passed to every actor (default: $ORCAPOD_MODEL, else the "
        "embedded one, prepared at the first start)",
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag passed to every worker, e.g. --worker-arg=--kv-cache-bytes=268435456",
    )
    parser.add_argument(
        "--scheduler-arg", action="append", default=[], help="extra flag passed to the scheduler"
    )
    parser.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="extra flag passed to every gateway, e.g. --gateway-arg=--allowed-origin=https://chat.example",
    )
    parser.add_argument(
        "--redis-maxmemory",
        default=DEFAULT_MAXMEMORY,
        help="memory cap of the embedded redis-server, e.g. 512mb or 2gb (a full Redis "
        "refuses writes; it never evicts); ignored with REDIS_URL",
    )
    return parser


def _ensure_model(model_arg: str | None) -> str:
    location = model_location(model_dir=model_arg)
    if location.is_embedded and not location.model_dir.is_dir():
        from gpu_worker.model_prepare import prepare_model

        print("preparing the embedded model (once)...", flush=True)
        prepare_model(location.cache_dir)
    return str(location.model_dir)


def exposure_line(host: str, num_keys: int) -> str:
    """The line ``orcapod up`` prints about API keys; raises UnprotectedHostError
    when ``host`` reaches beyond loopback and no key is configured."""
    if num_keys > 0:
        return f"API keys required ({num_keys} configured)"
    if not is_loopback_host(host):
        raise UnprotectedHostError(
            f"--host {host} without any API key would open the service to anyone; "
            "configure keys (--tenants-file, or `orcapod tenants add-key` with REDIS_URL) "
            "or listen on 127.0.0.1"
        )
    return "no API keys configured: one open tenant, listening on loopback only"


def _num_keys(host: str, tenants_path: Path | None, redis_url: str | None) -> int:
    """Keys in the tenants file, and (only when it matters: beyond loopback with
    none in the file) in the Redis hash of an external Redis."""
    num_keys = 0
    if tenants_path is not None:
        try:
            text = tenants_path.read_text(encoding="utf-8")
        except OSError as error:
            raise TenantConfigError(f"cannot read {tenants_path}: {error}") from error
        num_keys = parse_tenants_toml(text, source=str(tenants_path)).num_keys
    if num_keys == 0 and redis_url is not None and not is_loopback_host(host):
        with redis.Redis.from_url(redis_url, socket_timeout=5.0) as client:
            num_keys = int(client.hlen(RedisKeys(redis_settings().prefix).tenants))
    return num_keys


def free_metrics_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free loopback ports, none of them in ``taken``."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_loopback_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


def metrics_lines(
    scheduler_port: int, worker_ports: list[int], gateway_host: str, gateway_ports: list[int]
) -> list[str]:
    """Where each actor serves ``/metrics``: the scheduler and the workers on
    loopback, each gateway on its own host and port."""
    endpoints = [("scheduler", metrics_url("127.0.0.1", scheduler_port))]
    endpoints += [
        (f"worker-{i}", metrics_url("127.0.0.1", port)) for i, port in enumerate(worker_ports)
    ]
    endpoints += [
        (f"gateway-{i}", metrics_url(gateway_host, port)) for i, port in enumerate(gateway_ports)
    ]
    width = max(len(name) for name, _ in endpoints)
    return ["  metrics (Prometheus):"] + [f"    {name:<{width}}  {url}" for name, url in endpoints]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def _print_ready(args: argparse.Namespace, model_dir: str, metrics_ports: list[int]) -> None:
    print("orcapod is ready:", flush=True)
    for i in range(args.gateways):
        root = f"http://{args.host}:{args.port + i}"
        print(
            f"  ws://{args.host}:{args.port + i}/ws   OpenAI API: {root}/v1   "
            f"(health: {root}/health)",
            flush=True,
        )
    print(f"  policy {args.policy}, {args.workers} worker(s), model {model_dir}")
    gateway_ports = [args.port + i for i in range(args.gateways)]
    for line in metrics_lines(metrics_ports[0], metrics_ports[1:], args.host, gateway_ports):
        print(line)
    page = f"http://{args.host}:{args.port}"
    print(f"  chat in the browser: {page}/   the scheduler, live: {page}/dashboard")
    print(
        "  chat with: orcapod chat --url "
        f"ws://{args.host}:{args.port}/ws   (Ctrl-C here stops everything)",
        flush=True,
    )


def _serve(
    args: argparse.Namespace,
    model_dir: str,
    redis_url: str,
    tenants_path: Path | None,
    embedded: EmbeddedRedis | None,
    stopping: threading.Event,
) -> int:
    """Start the scheduler, the workers and the gateways, restart whichever
    exits (the embedded redis-server too) until ``stopping`` is set or a child
    cannot be restarted, then stop the actors in order; the exit code."""
    tenants_args = ["--tenants-file", str(tenants_path)] if tenants_path else []
    env = environment_with(REDIS_URL=redis_url)
    gateway_ports = [args.port + i for i in range(args.gateways)]
    # Chosen once: a restarted actor keeps its command line, so its port too.
    metrics_ports = free_metrics_ports(1 + args.workers, set(gateway_ports))
    scheduler_metrics_port, *worker_metrics_ports = metrics_ports

    scheduler = start_child(
        "scheduler",
        python_module(
            "scheduler_actor",
            "--policy",
            args.policy,
            "--metrics-port",
            str(scheduler_metrics_port),
            "--model",
            model_dir,
            *args.scheduler_arg,
        ),
        env,
    )
    workers = [
        start_child(
            f"worker-{i}",
            python_module(
                "gpu_worker",
                "--worker-id",
                f"worker-{i}",
                "--model",
                model_dir,
                "--metrics-port",
                str(worker_metrics_ports[i]),
                "--pipeline-parallel",
                str(args.pipeline_parallel),
                "--tensor-parallel",
                str(args.tensor_parallel),
                *args.worker_arg,
            ),
            env,
        )
        for i in range(args.workers)
    ]
    gateways = [
        start_child(
            f"gateway-{i}",
            python_module(
                "gateway",
                "--gateway-id",
                f"gateway-{i}",
                "--host",
                args.host,
                "--port",
                str(args.port + i),
                "--model",
                model_dir,
                *tenants_args,
                *args.gateway_arg,
            ),
            env,
        )
        for i in range(args.gateways)
    ]
    # Redis first: every actor waits on it.
    supervised = [*([embedded.child] if embedded else []), scheduler, *workers, *gateways]
    backoffs = {child.name: RestartBackoff(RESTART_POLICY) for child in supervised}
    restart_at_s: dict[str, float] = {}

    def restart(child: Child) -> None:
        if embedded is not None and child is embedded.child:
            # Same port, password and folder: the actors reconnect to what they knew.
            restart_embedded_redis(embedded)
        else:
            restart_child(child)

    exit_code = 0
    try:
        health_url = f"http://{args.host}:{args.port}/healthz"
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = False
        while not stopping.is_set():
            try:
                restart_exited(supervised, backoffs, restart_at_s, restart)
            except (CrashLoopError, EmbeddedRedisError) as error:
                print(f"orcapod up: {error}; stopping everything", file=sys.stderr)
                exit_code = 1
                break
            if not ready and _healthy(health_url):
                ready = True
                _print_ready(args, model_dir, metrics_ports)
            if not ready and time.monotonic() > deadline:
                print("orcapod up: no gateway became healthy in time", file=sys.stderr)
                exit_code = 1
                break
            stopping.wait(0.25)
    finally:
        # The terminal may be gone (SIGHUP): that must not cut the stop short.
        with contextlib.suppress(OSError):
            print("stopping...", flush=True)
        # Gateways first, all at once: each lets its requests in flight finish
        # (workers still running) for up to its drain timeout; then the work.
        stop_together(gateways, timeout_s=DEFAULT_DRAIN_TIMEOUT_S + GATEWAY_STOP_MARGIN_S)
        stop_children([*workers, scheduler])
    return exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``orcapod up``."""
    args = build_parser().parse_args(argv)
    counts = (args.workers, args.gateways, args.pipeline_parallel, args.tensor_parallel)
    if min(counts) < 1:
        print(
            "orcapod up: --workers, --gateways, --pipeline-parallel and --tensor-parallel "
            "must be >= 1",
            file=sys.stderr,
        )
        return 2
    tenants_path = tenants_file(args.tenants_file)
    try:
        num_keys = _num_keys(args.host, tenants_path, redis_url_from_environment())
        print(exposure_line(args.host, num_keys), flush=True)
    except TenantConfigError as error:
        print(f"orcapod up: {error}", file=sys.stderr)
        return 2
    except (RedisError, OSError) as error:
        print(f"orcapod up: cannot count the API keys in Redis: {error}", file=sys.stderr)
        return 1
    stopping = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    # SIGHUP too (the terminal closed): each stops in order and removes the data folder.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, request_stop)

    model_dir = _ensure_model(args.model)
    redis_url = redis_url_from_environment()
    embedded = None
    if redis_url is None:
        for folder in remove_stale_data_dirs():
            print(f"orcapod up: removed {folder}: the process that made it is gone", flush=True)
        try:
            embedded = start_embedded_redis(maxmemory=args.redis_maxmemory)
        except EmbeddedRedisError as error:
            print(f"orcapod up: {error}", file=sys.stderr)
            return 1
        redis_url = embedded.url
        print(
            f"embedded redis-server on {redis_url.split('@')[-1]} (password protected)", flush=True
        )
    try:
        exit_code = _serve(args, model_dir, redis_url, tenants_path, embedded, stopping)
    finally:
        if embedded is not None:
            # The store last, so nobody loses its Redis while draining; then its
            # folder (the password, every request's log) goes.
            stop_children([embedded.child])
            remove_data(embedded)
    with contextlib.suppress(OSError):
        print("stopped.")
    return exit_code
