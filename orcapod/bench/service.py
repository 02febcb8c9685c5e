"""The service under test: ``orcapod up`` (or one gateway) on a Redis the benchmark owns.

The benchmark starts its own password-protected redis-server, so it knows the
URL and can read the workers' stats hash, and hands it to ``orcapod up``
through ``REDIS_URL``. Between services the database is flushed, so every
policy starts from the same empty state. Everything binds to 127.0.0.1.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import redis

from orcapod.embedded_redis import (
    EmbeddedRedis,
    free_loopback_port,
    remove_data,
    start_embedded_redis,
)
from orcapod.processes import environment_with, stop_children

# A worker's first start on a 2-core CPU compiles its decode graphs (about three
# minutes on a Xeon, more on slower cores; a few seconds once cached).
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0


class ServiceError(RuntimeError):
    """The service did not come up."""


def healthy(url: str) -> bool:
    """True when ``url`` (a /healthz) answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def benchmark_redis() -> Iterator[EmbeddedRedis]:
    """A private redis-server for the whole benchmark, stopped at the end."""
    embedded = start_embedded_redis()
    try:
        yield embedded
    finally:
        stop_children([embedded.child])
        remove_data(embedded)


def flush(redis_url: str) -> None:
    """Empty the benchmark's Redis (streams, stats, epoch) between services."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.flushdb()
    finally:
        client.close()


def _wait_healthy(process: subprocess.Popen[bytes], health_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not healthy(health_url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            tail = log_path.read_text(errors="replace")[-3000:]
            raise ServiceError(f"the service did not become healthy; log tail:\n{tail}")
        time.sleep(0.5)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# The gateway's caps per tenant (flags --max-requests-per-tenant, --default-max-queued).
LOAD_GENERATOR_TENANT_CAPS = {
    "ORCAPOD_MAX_REQUESTS_PER_TENANT": "100000",
    "ORCAPOD_DEFAULT_MAX_QUEUED": "100000",
}
# A benchmark measures the compiled paths: the worker builds them before it
# serves (a user's worker serves eagerly meanwhile: gpu_worker/path_compiler.py).
COMPILED_BEFORE_SERVING = {"ORCAPOD_SERVE_WHILE_COMPILING": "0"}


@contextmanager
def orcapod_up(
    redis_url: str,
    policy: str,
    log_path: Path,
    up_args: Sequence[str] = (),
    environment: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """``orcapod up --policy POLICY`` on a free loopback port (``environment``:
    more variables for every actor); yields the websocket URL.

    A load generator is one tenant standing for many users, so the per-tenant
    caps that keep real tenants apart are lifted (``environment`` may set them).
    """
    environment = {**LOAD_GENERATOR_TENANT_CAPS, **COMPILED_BEFORE_SERVING, **(environment or {})}
    port = free_loopback_port()
    argv = [sys.executable, "-m", "orcapod", "up", "--port", str(port), "--policy", policy]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*argv, *up_args],
            env=environment_with(REDIS_URL=redis_url, **environment),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_healthy(process, f"http://127.0.0.1:{port}/healthz", log_path)
            yield f"ws://127.0.0.1:{port}/ws"
        finally:
            _stop(process)
            flush(redis_url)


@contextmanager
def one_gateway(
    redis_url: str, gateway_id: str, log_path: Path, model_dir: str | None
) -> Iterator[tuple[str, int]]:
    """``python -m gateway`` alone (no scheduler, no worker); yields (ws URL, pid)."""
    port = free_loopback_port()
    argv = [sys.executable, "-m", "gateway", "--gateway-id", gateway_id, "--port", str(port)]
    if model_dir:
        argv += ["--model", model_dir]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, env=environment_with(REDIS_URL=redis_url), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            # /healthz needs a scheduler; a 503 already proves the gateway listens.
            while not _answers(f"http://127.0.0.1:{port}/healthz"):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise ServiceError("the gateway did not start; see " + str(log_path))
                time.sleep(0.2)
            yield f"ws://127.0.0.1:{port}/ws", process.pid
        finally:
            _stop(process)
            flush(redis_url)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False
