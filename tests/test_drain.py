"""SIGTERM drains, with real processes.

A gateway that gets SIGTERM stops accepting sockets, refuses new requests on
the open ones, lets the requests in flight finish, then closes and exits 0
(the test publishes the tokens a worker would, so no model runs). A worker
that gets SIGTERM finishes its step, sends WorkerLeft and exits 0; the
scheduler recomputes its request on the other worker, and the client still
gets every token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import (
    SampledToken,
    SamplingParams,
    SubmitRequest,
    TokenBatch,
    decode_gateway_message,
    encode,
)
from shared.protocol import Accepted, Done, Error, Token, decode_server_message
from tests.conftest import RedisServer, free_port
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
KEYS = RedisKeys("orcapod")
GATEWAY_ID = "gw-drain"
TIMEOUT_S = 10.0
SHUTTING_DOWN = "gateway is shutting down, reconnect elsewhere"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny", "llama")


class Actors:
    """Actor processes of one test, killed at the end if still running; logs kept."""

    def __init__(self, redis_url: str, directory: Path) -> None:
        self._env = {**os.environ, "REDIS_URL": redis_url}
        self._directory = directory
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, module: str, *args: str) -> subprocess.Popen[bytes]:
        with self.log_path(name).open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=ROOT,
                env=self._env,
                stdout=log,
                stderr=log,
            )
        self.processes[name] = process
        return process

    def log_path(self, name: str) -> Path:
        return self._directory / f"{name}.log"

    def log(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    def assert_running(self) -> None:
        for name, process in self.processes.items():
            assert process.poll() is None, f"{name} exited:\n{self.log(name)}"

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def actors(redis_server: RedisServer, tmp_path: Path) -> Iterator[Actors]:
    started = Actors(redis_server.url, tmp_path)
    try:
        yield started
    finally:
        started.stop_all()
        for name in started.processes:
            sys.stderr.write(f"--- {name} log ---\n{started.log(name)[-4000:]}\n")


def _answers_http(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # 503 before a worker is ready: listening all the same
    except (urllib.error.URLError, OSError):
        return False


async def _receive(socket: ClientConnection) -> object:
    return decode_server_message(await asyncio.wait_for(socket.recv(), TIMEOUT_S))


async def _wait_for_log(actors: Actors, name: str, text: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while text not in actors.log(name):
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{actors.log(name)}"
        await asyncio.sleep(0.05)


def _tokens(request_id: str, indices: range, last: int) -> bytes:
    tokens = [
        SampledToken(
            request_id=request_id,
            token_id=10 + index,
            index=index,
            finish_reason="length" if index == last else None,
        )
        for index in indices
    ]
    return encode(TokenBatch(worker_id="w0", tokens=tokens))


def test_gateway_sigterm_finishes_requests_in_flight_refuses_new_ones_and_exits_0(
    redis_server: RedisServer, actors: Actors, model_dir: Path
) -> None:
    port = free_port()
    gateway = actors.start(
        "gateway",
        "gateway",
        f"--gateway-id={GATEWAY_ID}",
        f"--port={port}",
        f"--model={model_dir}",
        "--drain-timeout-s=30",
    )
    deadline = time.monotonic() + 60
    while not _answers_http(port):
        actors.assert_running()
        assert time.monotonic() < deadline, "the gateway never listened"
        time.sleep(0.1)
    url = f"ws://127.0.0.1:{port}/ws"

    async def scenario() -> None:
        upstream = aioredis.Redis.from_url(redis_server.url)
        try:
            async with connect(url) as socket:
                generate = {"type": "generate", "id": "a", "prompt": "<t5> <t6>", "max_tokens": 4}
                await socket.send(json.dumps(generate))
                accepted = await _receive(socket)
                assert isinstance(accepted, Accepted), accepted
                request_id = accepted.request_id
                channel = KEYS.tokens(GATEWAY_ID)
                assert await upstream.publish(channel, _tokens(request_id, range(2), 3)) == 1
                for seq in range(2):
                    token = await _receive(socket)
                    assert isinstance(token, Token) and token.seq == seq, token

                sigterm_at_s = time.monotonic()
                gateway.send_signal(signal.SIGTERM)
                await _wait_for_log(actors, "gateway", "gateway_draining")
                # No new sockets...
                with pytest.raises((OSError, InvalidStatus)):
                    async with connect(url, open_timeout=2):
                        pass
                # ...and no new requests on the open ones...
                await socket.send(json.dumps({**generate, "id": "b"}))
                refused = await _receive(socket)
                assert refused == Error(code="queue_full", message=SHUTTING_DOWN, id="b")
                # ...but the request in flight still ends with `done`.
                assert await upstream.publish(channel, _tokens(request_id, range(2, 4), 3)) == 1
                frames = [await _receive(socket) for _ in range(3)]
                assert [type(frame) for frame in frames] == [Token, Token, Done], frames
                assert isinstance(frames[2], Done) and frames[2].finish_reason == "length"
                assert frames[2].usage.completion_tokens == 4
                # Then the gateway closes the socket ("going away") and exits.
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(socket.recv(), TIMEOUT_S)
                assert socket.close_code == 1001
            exit_code = await asyncio.to_thread(gateway.wait, TIMEOUT_S)
            assert exit_code == 0, actors.log("gateway")
            # Well before the 30 s drain timeout: it waited for the request, not the clock.
            assert time.monotonic() - sigterm_at_s < 15
            # The finished request was not cancelled upstream.
            control = await upstream.xrange(KEYS.control)
            assert not control, control
        finally:
            await upstream.aclose()

    asyncio.run(scenario())
    assert "num_unfinished" in actors.log("gateway")
    assert '"num_unfinished": 0' in actors.log("gateway")


def test_worker_sigterm_sends_worker_left_exits_0_and_its_request_finishes_elsewhere(
    redis_server: RedisServer, actors: Actors, model_dir: Path
) -> None:
    worker_args = [
        f"--model={model_dir}",
        "--device=cpu",
        "--dtype=float32",
        f"--kv-cache-bytes={4 << 20}",
    ]
    actors.start("scheduler", "scheduler_actor")
    for worker_id in ("w1", "w2"):
        actors.start(worker_id, "gpu_worker", f"--worker-id={worker_id}", *worker_args)
    client = redis.Redis.from_url(redis_server.url)
    pubsub = client.pubsub()
    try:
        pubsub.subscribe(KEYS.tokens(GATEWAY_ID))
        deadline = time.monotonic() + 60
        while len(_events(actors.log("scheduler"), "worker_joined")) < 2 or not client.exists(
            KEYS.ready
        ):
            actors.assert_running()
            assert time.monotonic() < deadline, "the workers never joined"
            time.sleep(0.1)
        max_tokens = 480  # the tiny model's context is 512
        submit = SubmitRequest(
            request_id="r-drain",
            gateway_id=GATEWAY_ID,
            tenant="tenant",
            prompt_ids=[3 + i % (TINY_VOCAB_SIZE - 3) for i in range(20)],
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        client.xadd(KEYS.requests, {MESSAGE_FIELD: encode(submit)})

        received: dict[int, str] = {}
        finished = False
        stopped: str | None = None
        deadline = time.monotonic() + 60
        while not finished:
            assert time.monotonic() < deadline, f"{len(received)} tokens, then nothing"
            message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message is None:
                continue
            batch = decode_gateway_message(message["data"])
            assert isinstance(batch, TokenBatch), batch
            for token in batch.tokens:
                received.setdefault(token.index, batch.worker_id)
                finished = finished or token.finish_reason == "length"
            if stopped is None and len(received) >= 20:
                # SIGTERM the worker serving the request, mid-request.
                stopped = batch.worker_id
                actors.processes[stopped].send_signal(signal.SIGTERM)
        assert stopped is not None
        exit_code = actors.processes[stopped].wait(timeout=20)
        assert exit_code == 0, actors.log(stopped)
        # Every token arrived; the later ones from the worker that stayed.
        assert sorted(received) == list(range(max_tokens))
        other = "w2" if stopped == "w1" else "w1"
        assert received[max_tokens - 1] == other
        # The scheduler read its WorkerLeft (the stream entry is deleted once applied)
        # and put the request back in the queue.
        [lost] = _events(actors.log("scheduler"), "worker_lost")
        assert lost["worker_id"] == stopped and lost["reason"] == "left", lost
        assert lost["num_requeued"] == 1, lost
        assert not client.exists(KEYS.worker_heartbeat(stopped))
        assert '"event": "worker_left"' in actors.log(stopped)
    finally:
        pubsub.close()
        client.close()
    for name in ("scheduler", other):
        actors.processes[name].send_signal(signal.SIGTERM)
    for name in ("scheduler", other):
        assert actors.processes[name].wait(timeout=20) == 0, actors.log(name)


def _events(log: str, event: str) -> list[dict[str, object]]:
    """The structlog JSON lines of ``log`` whose event is ``event``."""
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]
