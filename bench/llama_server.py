"""llama.cpp's ``llama-server`` (the build of ``bench.llama_cpp_build``), started for one
run on a free loopback port and stopped after it, and the flags that choose it."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.llama_cpp_build import (
    BUILD_COMMAND,
    DEFAULT_CACHE_DIR,
    binaries,
    packaged_gguf,
    repacking_runs,
)


def add_llama_arguments(parser: argparse.ArgumentParser) -> None:
    """``--llama-cache-dir`` (where the build is) and ``--llama-threads`` (its ``-t``)."""
    parser.add_argument("--llama-cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument(
        "--llama-threads",
        type=int,
        default=1,
        help="llama-server -t (at 2 on 2 cores it stalls beside the client: "
        "docs/history/benchmarks-notebook.md, AIPerf)",
    )


@contextlib.contextmanager
def llama_server(
    cache_dir: Path,
    threads: int,
    slots: int,
    context_tokens: int,
    log_path: Path,
    alias: str | None = None,
    ready_timeout_s: float = 120.0,
    model: Path | None = None,
) -> Iterator[str]:
    """llama.cpp's server (the build in ``cache_dir``) on ``model`` (default: the
    packaged GGUF) on a free loopback port, ``slots`` parallel slots sharing
    ``context_tokens``; yields its URL."""
    from orcapod.embedded_redis import free_loopback_port

    server = binaries(cache_dir)["llama-server"]
    if not server.exists():
        raise SystemExit(f"{server} is missing: {BUILD_COMMAND}")
    port = free_loopback_port()
    argv = [
        str(server), "-m", str(model or packaged_gguf()),
        "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-np", str(slots), "-c", str(context_tokens), "--no-webui",
        *(("-a", alias) if alias else ()),
        *(() if repacking_runs(cache_dir) else ("--no-repack",)),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while not _answers_ok(f"{url}/health"):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"llama-server did not become healthy; see {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _answers_ok(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
        return int(response.status) == 200
    return False
