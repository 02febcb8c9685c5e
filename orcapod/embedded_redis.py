"""The redis-server ``orcapod up`` starts when ``REDIS_URL`` is not set.

It listens on a free loopback port, keeps its data in a temporary folder,
and requires a random password, so nothing else on the machine can use it
by accident. Its memory is capped (``maxmemory``, default 512 MB) with the
``noeviction`` policy: a full Redis refuses writes ("OOM command not
allowed"), which every actor retries with backoff, rather than dropping keys
(a request log, a pending submit) that the service's durability rests on.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from orcapod.processes import Child, start_child

DEFAULT_MAXMEMORY = "512mb"

INSTALL_HINT = (
    "redis-server is not installed. Install it (Debian/Ubuntu: sudo apt-get install "
    "redis-server; macOS: brew install redis) or point REDIS_URL at a running Redis."
)


class EmbeddedRedisError(RuntimeError):
    """redis-server is missing or did not start."""


@dataclass
class EmbeddedRedis:
    """A running redis-server child and the URL to reach it."""

    child: Child
    url: str
    data_dir: Path


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_embedded_redis(
    timeout_s: float = 10.0, maxmemory: str = DEFAULT_MAXMEMORY
) -> EmbeddedRedis:
    """Start redis-server (capped at ``maxmemory``, a redis size like "512mb")
    and wait until it accepts connections."""
    if not maxmemory.strip() or any(c.isspace() for c in maxmemory):
        raise EmbeddedRedisError(f"--redis-maxmemory {maxmemory!r} is not a size like 512mb")
    executable = shutil.which("redis-server")
    if executable is None:
        raise EmbeddedRedisError(INSTALL_HINT)
    port = free_loopback_port()
    password = secrets.token_hex(16)
    data_dir = Path(tempfile.mkdtemp(prefix="orcapod-redis-"))
    config = data_dir / "redis.conf"
    # The password goes in a file, not on the command line, where ps would show it.
    config.write_text(
        f"port {port}\nbind 127.0.0.1\nrequirepass {password}\ndir {data_dir}\n"
        'appendonly yes\nsave ""\nprotected-mode yes\nloglevel warning\n'
        f"maxmemory {maxmemory}\nmaxmemory-policy noeviction\n"
        # Its own log file: its banner and notices would drown the service's output.
        f"logfile {data_dir / 'redis.log'}\n",
        encoding="utf-8",
    )
    config.chmod(0o600)
    child = start_child("redis", [executable, str(config)])
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError as error:
            if child.process.poll() is not None or time.monotonic() > deadline:
                child.process.kill()
                raise EmbeddedRedisError(f"redis-server did not start on port {port}") from error
            time.sleep(0.05)
    return EmbeddedRedis(
        child=child, url=f"redis://:{password}@127.0.0.1:{port}/0", data_dir=data_dir
    )


def remove_data(redis: EmbeddedRedis) -> None:
    """Delete the temporary data folder once redis-server has stopped."""
    shutil.rmtree(redis.data_dir, ignore_errors=True)
