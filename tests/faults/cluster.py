"""A whole orcapod service as real processes, for fault tests.

redis-server (append-only file on, so a restart keeps the streams), the
scheduler, workers and gateways each run as their own process on the real
model; a test kills (SIGKILL), restarts and stops them by name. Every log is
kept, and printed when the test fails (pytest shows captured output then).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import RequestLogEntry, decode_log_entry
from tests.conftest import free_port, start_redis_server

ROOT = Path(__file__).resolve().parents[2]
KEYS = RedisKeys("faults")
KV_CACHE_BYTES = 64 << 20
START_TIMEOUT_S = 60.0


class ClusterError(AssertionError):
    """The service did not get where a test needs it."""


@dataclass
class Cluster:
    """Named processes of one service; ``stop`` ends them all."""

    tmp_path: Path
    model_dir: Path
    redis_port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    gateway_ports: dict[str, int] = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        """Where the service's Redis listens."""
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def redis(self) -> redis.Redis:
        """A plain client for the test's own checks."""
        return redis.Redis.from_url(self.redis_url)

    # --- starting ----------------------------------------------------------------------

    def start_redis(self) -> None:
        """redis-server with its append-only file, so a restart keeps everything."""
        data_dir = self.tmp_path / "redis-data"
        data_dir.mkdir(exist_ok=True)
        self.processes["redis"] = start_redis_server(
            self.redis_port,
            data_dir,
            self.tmp_path / "redis.log",
            *("--appendonly", "yes", "--appendfsync", "always"),
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.redis().ping():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError("redis-server did not start")
            time.sleep(0.05)

    def start_scheduler(self, *extra: str) -> None:
        """The scheduler; a lost worker is noticed about a second after its key expires."""
        self._start_actor("scheduler", "scheduler_actor", "--worker-timeout-s=0.5", *extra)

    def start_worker(self, worker_id: str, *extra: str) -> None:
        """One worker on the real model, on the CPU: fp32 activations, the default weights."""
        self._start_actor(
            worker_id,
            "gpu_worker",
            f"--worker-id={worker_id}",
            f"--model={self.model_dir}",
            "--device=cpu",
            "--dtype=float32",
            f"--kv-cache-bytes={KV_CACHE_BYTES}",
            "--heartbeat-s=0.3",
            *extra,
        )

    def start_gateway(self, gateway_id: str) -> None:
        """One gateway on a free loopback port."""
        port = free_port()
        self.gateway_ports[gateway_id] = port
        self._start_actor(
            gateway_id,
            "gateway",
            f"--gateway-id={gateway_id}",
            f"--model={self.model_dir}",
            "--host=127.0.0.1",
            f"--port={port}",
        )

    def _start_actor(self, name: str, module: str, *args: str) -> None:
        common = [f"--redis-url={self.redis_url}", f"--prefix={KEYS.prefix}"]
        self._spawn(name, [sys.executable, "-m", module, *common, *args])

    def _spawn(self, name: str, command: Sequence[str]) -> None:
        log_path = self.tmp_path / f"{name}.log"
        with log_path.open("ab") as log:
            log.write(f"--- started: {' '.join(command)}\n".encode())
            log.flush()
            self.processes[name] = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log)

    def start_service(
        self, worker_ids: Sequence[str] = ("w0",), gateway_ids: Sequence[str] = ("g0",)
    ) -> None:
        """Redis, the scheduler, the workers and the gateways; back once all are ready."""
        self.start_redis()
        self.start_scheduler()
        for worker_id in worker_ids:
            self.start_worker(worker_id)
        for gateway_id in gateway_ids:
            self.start_gateway(gateway_id)
        self.wait_ready(worker_ids)

    # --- waiting -----------------------------------------------------------------------

    def wait_ready(self, worker_ids: Sequence[str] = ()) -> None:
        """Until every gateway answers /healthz with 200 and each named worker
        has joined the running scheduler."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for gateway_id, port in self.gateway_ports.items():
            while not _healthy(port):
                self._check_alive(deadline, f"gateway {gateway_id} never became healthy")
                time.sleep(0.1)
        for worker_id in worker_ids:
            while not self.log_events("scheduler", "worker_joined", worker_id=worker_id):
                self._check_alive(deadline, f"{worker_id} never joined")
                time.sleep(0.1)

    def _check_alive(self, deadline: float, message: str) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise ClusterError(f"{name} exited with {process.returncode}: {message}")
        if time.monotonic() > deadline:
            raise ClusterError(message)

    def log_events(self, name: str, event: str, **fields: Any) -> list[dict[str, Any]]:
        """The JSON log entries of ``name`` (since its first start) whose ``event`` is
        ``event`` and whose fields equal ``fields``, parsed.

        Fields are compared as parsed values, never as substrings of a line: an
        epoch of 2 does not match a timestamp holding a 2.
        """
        entries = []
        text = (self.tmp_path / f"{name}.log").read_text(errors="replace")
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # the launch line, or a traceback
            if not isinstance(entry, dict) or entry.get("event") != event:
                continue
            if all(key in entry and entry[key] == value for key, value in fields.items()):
                entries.append(entry)
        return entries

    def request_log(self, request_id: str) -> list[RequestLogEntry]:
        """A request's durable log (shared/request_log.py), decoded in order."""
        raw: Any = self.redis().xrange(KEYS.request_log(request_id))
        return [decode_log_entry(fields[MESSAGE_FIELD.encode()]) for _, fields in raw]

    # --- faults ------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL: no cleanup of any kind."""
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def restart_redis(self, down_s: float = 0.0) -> None:
        """Stop redis-server (it writes its append-only file), wait ``down_s``,
        and start it again on the same port."""
        process = self.processes["redis"]
        process.terminate()
        process.wait(timeout=10)
        time.sleep(down_s)
        self.start_redis()

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every process still running (Redis last); their exit statuses."""
        statuses: dict[str, int | None] = {}
        for name, process in sorted(self.processes.items(), key=lambda item: item[0] == "redis"):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            statuses[name] = process.returncode
        return statuses

    def dump_logs(self) -> None:
        """Every process's log, to stderr."""
        for name in self.processes:
            text = (self.tmp_path / f"{name}.log").read_text(errors="replace")
            sys.stderr.write(f"--- {name} log ---\n{text[-20000:]}\n")

    def ws_url(self, gateway_id: str) -> str:
        """A gateway's websocket endpoint."""
        return f"ws://127.0.0.1:{self.gateway_ports[gateway_id]}/ws"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


# --- the client side ---------------------------------------------------------------------


@dataclass
class Stream:
    """What a client received for one request."""

    client_id: str
    request_id: str = ""
    seqs: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    token_times_s: list[float] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The text so far."""
        return "".join(self.texts)

    @property
    def last_seq(self) -> int:
        """The last seq received (-1 before any)."""
        return self.seqs[-1] if self.seqs else -1

    def take(self, frame: dict[str, Any]) -> None:
        """One server frame for this request."""
        kind = frame["type"]
        if kind == "accepted":
            self.request_id = frame["request_id"]
        elif kind == "token":
            self.seqs.append(frame["seq"])
            self.texts.append(frame["text"])
            self.token_times_s.append(time.monotonic())
        elif kind == "done":
            self.done = frame
        elif kind == "error":
            self.error = frame

    @property
    def ended(self) -> bool:
        """A `done` or an `error` arrived."""
        return self.done is not None or self.error is not None


PROMPTS = (
    "Name three rivers in Europe.",
    "Write a haiku about the sea.",
    "What is the capital of Japan?",
    "Explain what a CPU cache is in one paragraph.",
)


def generate_frame(client_id: str, prompt: str, max_tokens: int) -> str:
    """A greedy chat request that runs exactly ``max_tokens`` tokens."""
    return json.dumps(
        {
            "type": "generate",
            "id": client_id,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
    )


async def read_into(
    socket: ClientConnection,
    streams: dict[str, Stream],
    until_s: float,
    enough: Callable[[dict[str, Stream]], bool] | None = None,
) -> None:
    """Read frames into ``streams`` until ``enough`` says so (default: each has
    ended) or ``until_s`` passes; a closed socket ends the reading too."""
    done = enough or (lambda all_streams: all(s.ended for s in all_streams.values()))
    while not done(streams):
        remaining_s = until_s - time.monotonic()
        if remaining_s <= 0:
            return
        try:
            raw = await asyncio.wait_for(socket.recv(), timeout=remaining_s)
        except (TimeoutError, ConnectionClosed):
            return
        frame = json.loads(raw)
        stream = streams.get(frame.get("id") or "")
        if stream is None:
            raise AssertionError(f"a frame for no request: {frame}")
        stream.take(frame)


def each_has_tokens(count: int) -> Callable[[dict[str, Stream]], bool]:
    """``enough`` for ``read_into``: every stream has ``count`` tokens."""
    return lambda streams: all(len(s.seqs) >= count for s in streams.values())


async def send_requests(socket: ClientConnection, max_tokens: int) -> dict[str, Stream]:
    """Send every prompt of ``PROMPTS`` on ``socket``; their (empty) streams."""
    streams = {f"q{i}": Stream(f"q{i}") for i in range(len(PROMPTS))}
    for (client_id, _), prompt in zip(streams.items(), PROMPTS, strict=True):
        await socket.send(generate_frame(client_id, prompt, max_tokens))
    return streams


async def run_requests(url: str, max_tokens: int, timeout_s: float = 120.0) -> dict[str, Stream]:
    """Every prompt of ``PROMPTS`` at once on one socket, read to the end."""
    async with connect(url) as socket:
        streams = await send_requests(socket, max_tokens)
        await read_into(socket, streams, time.monotonic() + timeout_s)
    return streams


def assert_same_texts(streams: dict[str, Stream], reference: dict[str, Stream]) -> None:
    """Each request's text equals the reference run's (greedy: the undisturbed one)."""
    for client_id, stream in streams.items():
        assert stream.text == reference[client_id].text, client_id


def seconds_to_last_token(streams: dict[str, Stream], since_s: float) -> float:
    """From ``since_s`` (the fault) to the last token of any request."""
    return max(stream.token_times_s[-1] for stream in streams.values()) - since_s


def reference_run(url: str, max_tokens: int) -> dict[str, Stream]:
    """The undisturbed run a faulty one is compared with (checked exactly-once too)."""
    streams = asyncio.run(run_requests(url, max_tokens))
    assert_exactly_once(streams, max_tokens)
    return streams


def longest_gap_s(streams: dict[str, Stream]) -> float:
    """The longest wait between two tokens of one request: the fault's cost."""
    gaps = [
        later - earlier
        for stream in streams.values()
        for earlier, later in zip(stream.token_times_s, stream.token_times_s[1:], strict=False)
    ]
    return max(gaps, default=0.0)


def assert_exactly_once(streams: dict[str, Stream], max_tokens: int) -> None:
    """Each request ended with `done`, and got seq 0..max_tokens-1 once each, in order."""
    for stream in streams.values():
        assert stream.error is None, stream.error
        assert stream.done is not None, f"{stream.client_id} never ended: seqs {stream.seqs}"
        assert stream.seqs == list(range(max_tokens)), (stream.client_id, stream.seqs)
        assert stream.done["finish_reason"] == "length", stream.done
        assert stream.done["usage"]["completion_tokens"] == max_tokens, stream.done
