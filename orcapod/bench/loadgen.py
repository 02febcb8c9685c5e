"""The open-loop load generator: sends a trace over a pool of websockets.

Arrivals follow the trace's schedule whatever the service does (open loop):
a request is sent at its arrival time on the open socket with the fewest
requests in flight (a new socket is opened while every open one is full, up
to ``max_sockets``). Each socket has a reader task that timestamps every
frame. After the last arrival the run waits at most ``drain_timeout_s`` for
answers, then cancels what is left, so a run is bounded in time and leaves
no work queued behind it for the next one.

Traffic goes only to loopback addresses: this is a benchmark of a service on
this machine, never a load test of somebody else's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from tqdm import tqdm
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from orcapod.bench.metrics import RequestRecord
from orcapod.bench.traces import TraceRequest
from shared.protocol import Cancel, Done, Error, Token, decode_server_message, encode_json
from shared.settings import auth_headers

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CANCEL_WAIT_S = 10.0


class LoadError(RuntimeError):
    """The benchmark cannot run (bad URL, service unreachable)."""


def check_loopback(url: str) -> None:
    """Refuse any URL that is not a websocket on this machine."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or parts.hostname not in LOOPBACK_HOSTS:
        raise LoadError(f"{url!r}: orcapod bench only talks to ws://127.0.0.1 (loopback)")


@dataclass(frozen=True)
class LoadSettings:
    """How to drive the service."""

    url: str
    max_sockets: int = 8
    requests_per_socket: int = 64
    drain_timeout_s: float = 120.0
    seed: int = 0
    progress: bool = True
    api_key: str | None = None


@dataclass
class _Socket:
    connection: ClientConnection
    in_flight: set[str] = field(default_factory=set)


@dataclass
class LoadResult:
    """Every request's record, and the run's wall time (first send to last answer)."""

    records: list[RequestRecord]
    wall_s: float
    num_sockets: int
    num_late_sends: int  # requests sent over 100 ms after their arrival time


class LoadGenerator:
    """Runs one trace against one gateway URL."""

    def __init__(self, settings: LoadSettings) -> None:
        check_loopback(settings.url)
        self.settings = settings
        self._sockets: list[_Socket] = []
        self._records: dict[str, RequestRecord] = {}
        self._outstanding: set[str] = set()
        self._all_done = asyncio.Event()
        self._sending_done = False
        self._bar: tqdm | None = None

    async def run(self, trace: list[TraceRequest], description: str = "") -> LoadResult:
        """Send ``trace`` on schedule and collect every answer (bounded in time)."""
        self._bar = tqdm(
            total=len(trace), desc=description, unit="req", disable=not self.settings.progress
        )
        async with asyncio.TaskGroup() as tasks:
            readers: list[asyncio.Task[None]] = []
            started_s = time.monotonic()
            drained_s: float | None = None
            num_late = 0
            try:
                for request in trace:
                    delay_s = started_s + request.arrival_s - time.monotonic()
                    if delay_s > 0:
                        await asyncio.sleep(delay_s)
                    elif delay_s < -0.1:
                        num_late += 1
                    socket = await self._pick_socket(tasks, readers)
                    await self._send(socket, request)
                self._sending_done = True
                self._check_all_done()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_done.wait(), self.settings.drain_timeout_s)
                # With requests left, the service was busy until now.
                drained_s = time.monotonic() if self._outstanding else None
                await self._cancel_outstanding()
            finally:
                for socket in self._sockets:
                    await socket.connection.close()
                for reader in readers:
                    reader.cancel()
        self._bar.close()
        records = sorted(self._records.values(), key=lambda record: record.index)
        ends = [record.done_s for record in records if record.done_s and record.completed]
        first_s = min((record.sent_s for record in records), default=started_s)
        last_s = drained_s or max(ends, default=time.monotonic())
        wall_s = last_s - first_s
        return LoadResult(records, wall_s, len(self._sockets), num_late)

    async def _pick_socket(
        self, tasks: asyncio.TaskGroup, readers: list[asyncio.Task[None]]
    ) -> _Socket:
        limit = self.settings.requests_per_socket
        while True:
            open_sockets = [s for s in self._sockets if len(s.in_flight) < limit]
            if open_sockets:
                return min(open_sockets, key=lambda s: len(s.in_flight))
            if len(self._sockets) < self.settings.max_sockets:
                try:
                    connection = await connect(
                        self.settings.url,
                        open_timeout=30,
                        max_queue=None,
                        additional_headers=auth_headers(self.settings.api_key),
                    )
                except OSError as error:
                    raise LoadError(f"cannot connect to {self.settings.url}: {error}") from error
                socket = _Socket(connection)
                self._sockets.append(socket)
                readers.append(tasks.create_task(self._read(socket)))
                return socket
            # Every socket is full: the client, not the service, is the limit now.
            await asyncio.sleep(0.01)

    async def _send(self, socket: _Socket, request: TraceRequest) -> None:
        client_id = f"r{request.index}"
        record = RequestRecord(request.index, request.kind, request.max_tokens, time.monotonic())
        self._records[client_id] = record
        self._outstanding.add(client_id)
        socket.in_flight.add(client_id)
        message = request.generate_message(client_id, seed=self.settings.seed + request.index)
        try:
            await socket.connection.send(encode_json(message))
        except ConnectionClosed as error:
            self._finish(socket, client_id, error=f"socket closed: {error}")

    async def _read(self, socket: _Socket) -> None:
        try:
            async for frame in socket.connection:
                now = time.monotonic()
                message = decode_server_message(frame)
                record = self._records.get(message.id or "")
                if record is None:
                    continue
                if isinstance(message, Token):
                    record.token_times_s.append(now)
                elif isinstance(message, Done):
                    record.done_s = now
                    record.completion_tokens = message.usage.completion_tokens
                    record.finish_reason = message.finish_reason
                    self._finish(socket, message.id)
                elif isinstance(message, Error) and message.id is not None:
                    record.done_s = now
                    self._finish(socket, message.id, error=message.code)
        except ConnectionClosed:
            pass
        for client_id in list(socket.in_flight):
            self._finish(socket, client_id, error="socket closed")

    def _finish(self, socket: _Socket, client_id: str, error: str | None = None) -> None:
        if client_id not in self._outstanding:
            return
        record = self._records[client_id]
        if error is not None and record.error is None:
            record.error = error
        self._outstanding.discard(client_id)
        socket.in_flight.discard(client_id)
        if self._bar is not None:
            self._bar.update(1)
        self._check_all_done()

    def _check_all_done(self) -> None:
        if self._sending_done and not self._outstanding:
            self._all_done.set()

    async def _cancel_outstanding(self) -> None:
        """Cancel what is still running, so the next run starts on an idle service."""
        if not self._outstanding:
            return
        for socket in self._sockets:
            for client_id in list(socket.in_flight):
                with contextlib.suppress(ConnectionClosed):
                    await socket.connection.send(encode_json(Cancel(id=client_id)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_done.wait(), CANCEL_WAIT_S)


def run_trace(
    settings: LoadSettings, trace: list[TraceRequest], description: str = ""
) -> LoadResult:
    """``LoadGenerator.run`` in a fresh event loop."""
    try:
        return asyncio.run(LoadGenerator(settings).run(trace, description))
    except* LoadError as group:
        raise group.exceptions[0] from None
