"""API keys at the handshake and tenant isolation, end to end: a real GatewayServer, real
websockets clients, a real redis-server and the real tokenizer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.server import GatewayServer
from gateway.tenants import Tenant, UnprotectedHostError, hash_key, tenant_toml
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.messages import TenantLimits, encode
from shared.protocol import Done, Error, Token
from shared.settings import GatewaySettings, RedisSettings, model_location
from tests.conftest import RedisServer
from tests.gateway.test_server import (
    KEYS,
    TIMEOUT_S,
    FakeUpstream,
    accept,
    receive,
    receive_until_done,
    run_with_gateway,
    send,
)
from tests.gateway.worker_tokens import worker_tokens

KEY_A = "opk_key-of-tenant-a"
KEY_B = "opk_key-of-tenant-b"
KEY_METERED = "opk_key-of-a-metered-tenant"
TENANT_A = Tenant(name="a", weight=2.0, max_in_flight=3, max_tokens_per_request=100)
TENANT_B = Tenant(name="b")
METERED = Tenant(name="metered", tokens_per_minute=200)


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(
        tenant_toml(TENANT_A, [hash_key(KEY_A)])
        + tenant_toml(TENANT_B, [hash_key(KEY_B)])
        + tenant_toml(METERED, [hash_key(KEY_METERED)]),
        encoding="utf-8",
    )
    return path


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def refused(url: str, **options: Any) -> tuple[int, str]:
    """The status and body of a handshake the gateway refuses."""
    with pytest.raises(InvalidStatus) as caught:
        async with connect(url, **options):
            pass
    response = caught.value.response
    return response.status_code, response.body.decode()


async def silent(socket: ClientConnection, wait_s: float = 0.3) -> bool:
    try:
        await asyncio.wait_for(socket.recv(), wait_s)
    except TimeoutError:
        return True
    return False


def test_missing_or_bad_key_is_401_at_the_handshake(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tenants_file: Path,
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        status, body = await refused(server.url)
        assert status == 401 and "missing API key" in body and "Bearer" in body
        assert await refused(server.url, additional_headers=bearer("wrong")) == (
            401,
            "invalid API key\n",
        )
        status, _ = await refused(server.url, subprotocols=["orcapod", "bearer.wrong"])
        assert status == 401
        status, _ = await refused(server.url, additional_headers={"Authorization": KEY_A})
        assert status == 401  # a key without the Bearer scheme is no key
        assert server.session.num_sockets == 0

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file
    )


def test_both_key_conventions_connect_as_their_tenant(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tenants_file: Path,
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url, additional_headers=bearer(KEY_A)) as socket:
            assert socket.subprotocol is None
            await accept(socket, "q1", max_tokens=50)
            submit = await upstream.next_submit()
            assert submit.tenant == "a"
            # No max_queued in its record: the gateway's default (256) goes to the scheduler.
            assert submit.limits == TenantLimits(weight=2.0, max_queued=256, max_in_flight=3)
        # A browser's way: the key as a subprotocol; the server selects the other one.
        async with connect(server.url, subprotocols=["orcapod", f"bearer.{KEY_B}"]) as socket:
            assert socket.subprotocol == "orcapod"
            assert socket.response is not None
            assert socket.response.headers["Sec-WebSocket-Protocol"] == "orcapod"
            await accept(socket, "q1")
            submit = await upstream.next_submit()
            assert submit.tenant == "b" and submit.limits == TenantLimits(max_queued=256)

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file
    )


def test_a_tenant_cannot_resume_or_cancel_another_tenants_request(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tenants_file: Path,
) -> None:
    async def unknown_id_error(socket: ClientConnection, request_id: str) -> Error:
        await send(socket, type="resume", request_id=request_id, after_seq=-1)
        error = await receive(socket)
        assert isinstance(error, Error)
        return error

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with (
            connect(server.url, additional_headers=bearer(KEY_A)) as socket_a,
            connect(server.url, additional_headers=bearer(KEY_B)) as socket_b,
        ):
            request_b = await accept(socket_b, "b1")
            tokens = worker_tokens(chat_tokenizer, request_b, "one two three")
            await upstream.publish(tokens[0])
            assert isinstance(await receive(socket_b), Token)
            # Resume: exactly the answer an id that never existed gets.
            never = "f" * len(request_b)
            expected = await unknown_id_error(socket_a, never)
            error = await unknown_id_error(socket_a, request_b)
            assert error.code == expected.code == "invalid_request"
            assert error.message == expected.message.replace(never, request_b)
            # Cancel names the client's id on its own socket: b1 is not there.
            await send(socket_a, type="cancel", id="b1")
            cancel_error = await receive(socket_a)
            await send(socket_a, type="cancel", id="zz")
            other = await receive(socket_a)
            assert isinstance(cancel_error, Error) and isinstance(other, Error)
            assert cancel_error.message == other.message.replace("zz", "b1")
            assert await upstream.num_cancels() == 0
            # B's request went on, on B's socket only.
            await upstream.publish(*tokens[1:])
            frames, done = await receive_until_done(socket_b)
            assert [frame.seq for frame in frames] == [1, 2] and done.finish_reason == "length"
            assert await silent(socket_a)
        # Finished and retained: still invisible to A, replayed to any socket of B.
        async with connect(server.url, additional_headers=bearer(KEY_A)) as socket_a:
            assert (await unknown_id_error(socket_a, request_b)).code == "invalid_request"
        async with connect(server.url, additional_headers=bearer(KEY_B)) as socket_b:
            await send(socket_b, type="resume", request_id=request_b, after_seq=1)
            frames, done = await receive_until_done(socket_b)
            assert [frame.seq for frame in frames] == [2] and done.id == "b1"
        # On another gateway the request is known only from its log in Redis:
        # the tenant check holds there too.
        other_gateway = GatewayServer(
            _settings(redis_server, model_limits, tenants_file, gateway_id="gw-other"),
            chat_tokenizer,
            model_limits,
        )
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(other_gateway.run(stop))
            await asyncio.wait_for(other_gateway.listening.wait(), TIMEOUT_S)
            try:
                url = other_gateway.url
                async with connect(url, additional_headers=bearer(KEY_A)) as socket_a:
                    expected = await unknown_id_error(socket_a, never)
                    error = await unknown_id_error(socket_a, request_b)
                    assert error.message == expected.message.replace(never, request_b)
            finally:
                stop.set()

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file
    )


def test_tenant_caps_on_max_tokens_and_tokens_per_minute(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tenants_file: Path,
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url, additional_headers=bearer(KEY_A)) as socket:
            await send(socket, type="generate", id="big", prompt="Hi", max_tokens=101)
            error = await receive(socket)
            assert isinstance(error, Error) and error.code == "invalid_request"
            assert "over tenant 'a'" in error.message and "100" in error.message
            await accept(socket, "ok", max_tokens=100)
        # A fixed 60-s window: keep both requests inside one.
        if time.time() % 60 > 55:
            await asyncio.sleep(60 - time.time() % 60 + 0.1)
        async with connect(server.url, additional_headers=bearer(KEY_METERED)) as socket:
            # More than a whole minute's budget: can never run, so not "retry later".
            await send(socket, type="generate", id="never", prompt="Hi", max_tokens=250)
            error = await receive(socket)
            assert isinstance(error, Error) and error.code == "invalid_request"
            await accept(socket, "first", max_tokens=120)
            # The second does not fit the rest of this minute: queue_full at once.
            started_s = time.monotonic()
            await accept(socket, "second", max_tokens=120)
            error = await receive(socket)
            assert time.monotonic() - started_s < 2.0
            assert isinstance(error, Error) and error.code == "queue_full", error
            assert error.id == "second"
            assert "tokens-per-minute limit" in error.message and "retry in" in error.message
            # Only `ok` and `first` went upstream; the refused request took no budget.
            assert await upstream.redis.xlen(KEYS.requests) == 2
            counters = await upstream.redis.keys(f"{KEYS.prefix}:tpm:metered:*")
            assert len(counters) == 1
            reserved = int(await upstream.redis.get(counters[0]))
            assert 120 < reserved <= 200
            assert 0 < await upstream.redis.ttl(counters[0]) <= 120
            # The socket keeps working: a small request still fits.
            await accept(socket, "third", max_tokens=10)

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file
    )


def test_keys_added_to_redis_or_the_file_work_without_a_restart(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tenants_file: Path,
) -> None:
    async def connects(url: str, key: str, within_s: float) -> bool:
        deadline_s = time.monotonic() + within_s
        while True:
            try:
                async with connect(url, additional_headers=bearer(key)) as socket:
                    await accept(socket, "q")
                    return True
            except (ConnectionClosed, InvalidStatus) as refused:
                # A key revoked between the handshake and the answer: closed with 1008.
                if isinstance(refused, ConnectionClosed) and (
                    refused.rcvd is None or refused.rcvd.code != 1008
                ):
                    raise
                if time.monotonic() > deadline_s:
                    return False
                await asyncio.sleep(0.05)

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert not await connects(server.url, "opk_new", within_s=0)
        await upstream.redis.hset(KEYS.tenants, hash_key("opk_new"), encode(Tenant(name="c")))
        assert await connects(server.url, "opk_new", within_s=5)
        assert (await upstream.next_submit()).tenant == "c"
        # Revoked: new handshakes are refused again.
        await upstream.redis.hdel(KEYS.tenants, hash_key("opk_new"))
        deadline_s = time.monotonic() + 5
        while await connects(server.url, "opk_new", within_s=0):
            assert time.monotonic() < deadline_s
            await asyncio.sleep(0.05)
        # The file, edited: picked up by its mtime (or at once on SIGHUP).
        tenants_file.write_text(tenant_toml(Tenant(name="d"), [hash_key("opk_file")]))
        server.request_tenants_reload()
        assert await connects(server.url, "opk_file", within_s=5)
        assert not await connects(server.url, KEY_A, within_s=0)
        # A broken edit keeps the keys the file had.
        tenants_file.write_text("[tenants.d\n")
        server.request_tenants_reload()
        await asyncio.sleep(0.3)
        assert await connects(server.url, "opk_file", within_s=0)

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        tenants_file=tenants_file,
        tenants_reload_s=0.1,
    )


def _settings(
    redis_server: RedisServer,
    limits: ModelLimits,
    tenants_file: Path | None,
    *,
    gateway_id: str = "gw-auth",
    host: str = "127.0.0.1",
) -> GatewaySettings:
    return GatewaySettings(
        redis=RedisSettings(url=redis_server.url, prefix=KEYS.prefix),
        model=model_location(),
        gateway_id=gateway_id,
        host=host,
        port=0,
        heartbeat_s=0.2,
        max_tokens_limit=limits.max_tokens_limit,
        tenants_file=tenants_file,
    )


def test_a_gateway_beyond_loopback_needs_keys(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    prepared_model_dir: Path,
) -> None:
    settings = _settings(redis_server, model_limits, None, host="0.0.0.0")
    server = GatewayServer(settings, chat_tokenizer, model_limits)
    with pytest.raises(UnprotectedHostError, match="no API keys"):
        asyncio.run(server.run(asyncio.Event()))
    # The process: a clear error and exit status 2, before it listens.
    command = [sys.executable, "-m", "gateway", "--host", "0.0.0.0", "--port", "0"]
    command += ["--model", str(prepared_model_dir), "--redis-url", redis_server.url]
    command += ["--prefix", KEYS.prefix]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert "no API keys are configured" in result.stderr
    assert "Traceback" not in result.stderr


def test_without_keys_a_loopback_gateway_is_open_as_default(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            await accept(socket, "q")
            submit = await upstream.next_submit()
            assert submit.tenant == "default" and submit.limits == TenantLimits(max_queued=256)
            await upstream.publish(*worker_tokens(chat_tokenizer, submit.request_id, "hi"))
            _, done = await receive_until_done(socket)
            assert isinstance(done, Done)

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_orcapod_chat_sends_its_key_and_says_when_it_has_none(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tenants_file: Path,
) -> None:
    async def chat(*args: str, key: str | None) -> tuple[int, str, str]:
        env = {"PATH": "/usr/bin:/bin"} | ({"ORCAPOD_API_KEY": key} if key else {})
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "orcapod",
            "chat",
            *args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(b"/quit\n"), 60)
        assert process.returncode is not None
        return process.returncode, stdout.decode(), stderr.decode()

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        status, _, stderr = await chat("--url", server.url, key=None)
        assert status == 1 and "HTTP 401" in stderr and "ORCAPOD_API_KEY" in stderr
        assert "Traceback" not in stderr
        status, stdout, stderr = await chat("--url", server.url, key=KEY_B)
        assert status == 0 and f"connected to {server.url}" in stdout, stderr
        status, stdout, _ = await chat("--url", server.url, "--api-key", KEY_A, key="nope")
        assert status == 0 and "connected" in stdout

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file
    )
