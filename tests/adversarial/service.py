"""A real ``orcapod up`` for attacks: its own redis-server, tenants with keys,
every actor its own process; and a small websocket client that keeps each
request's frames apart.

The attacker and the victim are separate tenants. The service's Redis is a
redis-server this module starts (``REDIS_URL``), bounded like the embedded one
(``maxmemory``, ``noeviction``), so a test can read what an attack left there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from gateway.tenants import hash_key
from tests.conftest import descendants, free_port, start_redis_server, stop_process
from tests.up_process import UpProcess

PREFIX = "adv"
READY_TIMEOUT_S = 180.0
KEYS = {
    "victim": "key-victim",
    "attacker": "key-attacker",
    "doomed": "key-doomed",
    # Two tenants of one cache group: they share cached prompt prefixes.
    "team_a": "key-team-a",
    "team_b": "key-team-b",
}
# Pages of this origin may use the service, besides the gateway's own.
ALLOWED_ORIGIN = "https://chat.example"
# Things a client must never read in an error message: reprs, addresses,
# tracebacks, the store's own words.
INTERNALS = re.compile(r"Traceback|object at 0x|0x[0-9a-f]{8,}|Error\(|redis|Redis|\.py\b")
ROLES = ("redis-server", "-m scheduler_actor", "-m gpu_worker", "-m gateway")


def tenants_toml(names: Sequence[str]) -> str:
    """A tenants file holding the keys of ``names`` (attacker quotas kept small)."""
    quotas = {
        "attacker": "max_queued = 16\nmax_in_flight = 4\n",
        "team_a": 'cache_group = "team"\n',
        "team_b": 'cache_group = "team"\n',
    }
    return "".join(
        f'[tenants.{name}]\n{quotas.get(name, "")}key_sha256 = ["{hash_key(KEYS[name])}"]\n'
        for name in names
    )


def rss_bytes(pid: int) -> int:
    """Resident memory of one process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass
class Service:
    """One ``orcapod up`` and its Redis; ``pids`` are the actors at start."""

    tmp_path: Path
    model_dir: Path
    port: int = field(default_factory=free_port)
    redis_port: int = field(default_factory=free_port)
    up: UpProcess | None = None
    redis_process: subprocess.Popen[bytes] | None = None
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def tenants_path(self) -> Path:
        return self.tmp_path / "tenants.toml"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def start(self) -> None:
        self.redis_process = start_redis_server(
            self.redis_port,
            self.tmp_path,
            self.tmp_path / "redis.log",
            *("--maxmemory", "256mb", "--maxmemory-policy", "noeviction"),
        )
        self.write_tenants(list(KEYS))
        env = {**os.environ, "REDIS_URL": self.redis_url, "ORCAPOD_PREFIX": PREFIX}
        env.pop("ORCAPOD_TENANTS_FILE", None)
        self.up = UpProcess(
            [
                *("--port", str(self.port), "--model", str(self.model_dir)),
                *("--tenants-file", str(self.tenants_path)),
                "--worker-arg=--kv-cache-bytes=134217728",
                f"--gateway-arg=--allowed-origin={ALLOWED_ORIGIN}",
                # Short enough for tests/adversarial/test_connections.py to wait out.
                "--gateway-arg=--idle-timeout-s=2",
                "--gateway-arg=--header-timeout-s=3",
                "--gateway-arg=--body-timeout-s=3",
            ],
            env,
        )
        try:
            self.up.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        self.pids = self.actor_pids()

    def write_tenants(self, names: Sequence[str]) -> None:
        """Replace the tenants file atomically (the gateways re-read it within 2 s)."""
        staged = self.tenants_path.with_suffix(".tmp")
        staged.write_text(tenants_toml(names), encoding="utf-8")
        staged.replace(self.tenants_path)

    def actor_pids(self) -> dict[str, int]:
        """The live actor processes by role."""
        assert self.up is not None
        found = {}
        for pid, command in descendants(self.up.process.pid):
            for role in ROLES:
                if role in command:
                    found[role] = pid
        return found

    def assert_alive(self) -> None:
        """Every actor that was there at start is still the same process."""
        assert self.up is not None and self.up.process.poll() is None, "orcapod up exited"
        assert self.redis_process is not None and self.redis_process.poll() is None
        assert self.actor_pids() == self.pids, "an actor process exited or was replaced"

    def stop(self) -> None:
        if self.up is not None:
            self.up.stop()
        if self.redis_process is not None:
            stop_process(self.redis_process)


@dataclass
class Outcome:
    """Everything one request got: its frames in order."""

    frames: list[dict[str, Any]] = field(default_factory=list)

    @property
    def end(self) -> dict[str, Any] | None:
        last = self.frames[-1] if self.frames else None
        return last if last is not None and last["type"] in ("done", "error") else None

    @property
    def tokens(self) -> list[dict[str, Any]]:
        return [frame for frame in self.frames if frame["type"] == "token"]

    @property
    def request_id(self) -> str | None:
        accepted = [frame for frame in self.frames if frame["type"] == "accepted"]
        return accepted[0]["request_id"] if accepted else None


class Client:
    """One socket of one tenant; frames are filed by the request ``id`` they name."""

    def __init__(self, socket: ClientConnection) -> None:
        self.socket = socket
        self.outcomes: dict[str | None, Outcome] = {}
        self.arrivals_s: dict[str | None, list[float]] = {}

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.socket.send(frame if isinstance(frame, str) else json.dumps(frame))

    async def generate(self, client_id: str, **fields: Any) -> None:
        frame = {"type": "generate", "id": client_id, "max_tokens": 8, "temperature": 0.0}
        frame.update(fields)
        if not {"messages", "prompt", "prompt_token_ids"} & fields.keys():
            frame["messages"] = [{"role": "user", "content": "Say hello."}]
        await self.send(frame)

    async def read_one(self) -> None:
        """Receive one frame and file it under the request it names."""
        frame = json.loads(await self.socket.recv())
        key = frame.get("id")
        self.outcomes.setdefault(key, Outcome()).frames.append(frame)
        self.arrivals_s.setdefault(key, []).append(time.monotonic())

    async def until_answered(self, client_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Read until ``client_id`` got its first frame (accepted, or an error); that frame."""
        async with asyncio.timeout(timeout_s):
            while not self.outcomes.get(client_id):
                await self.read_one()
        return self.outcomes[client_id].frames[0]

    async def read_for(self, duration_s: float) -> None:
        """File every frame that arrives within ``duration_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(duration_s):
                while True:
                    await self.read_one()

    def errors(self) -> list[dict[str, Any]]:
        """Every ``error`` frame received so far."""
        return [f for o in self.outcomes.values() for f in o.frames if f["type"] == "error"]

    async def until_end(self, client_id: str | None, timeout_s: float = 120.0) -> Outcome:
        """Read until ``client_id``'s request ended (done or error)."""
        async with asyncio.timeout(timeout_s):
            while (outcome := self.outcomes.get(client_id)) is None or outcome.end is None:
                await self.read_one()
        return outcome

    async def ask(self, client_id: str, timeout_s: float = 120.0, **fields: Any) -> Outcome:
        await self.generate(client_id, **fields)
        return await self.until_end(client_id, timeout_s)


def open_socket(service: Service, tenant: str, **kwargs: Any) -> Any:
    """``async with open_socket(...) as socket`` for one tenant's key."""
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    return connect(service.url, additional_headers=headers, open_timeout=30, **kwargs)


async def wait_closed(socket: ClientConnection, timeout_s: float) -> int | None:
    """Drain a socket until the server closes it; the close code."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                await socket.recv()
    except ConnectionClosed:
        pass
    return socket.close_code
