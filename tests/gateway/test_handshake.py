"""The handshake, end to end: a page of another site is refused (403), so is
a request naming the gateway by a name it does not answer to (DNS
rebinding), a repeated credential header is a 400, the open tenant is
decided once at start, a revoked key closes its sockets (1008)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from gateway.connections import REVOKED_REASON
from gateway.server import GatewayServer
from gateway.tenants import Tenant, hash_key, tenant_toml
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from tests.conftest import RedisServer
from tests.gateway.test_server import (
    KEYS,
    TIMEOUT_S,
    FakeUpstream,
    accept,
    run_with_gateway,
)

KEY = "opk_handshake-key"
OTHER_KEY = "opk_other-key"
POLICY_VIOLATION = 1008


def write_tenants(path: Path, *keys: str) -> None:
    path.write_text(
        "".join(tenant_toml(Tenant(name=f"t{i}"), [hash_key(k)]) for i, k in enumerate(keys)),
        encoding="utf-8",
    )


async def status_of(url: str, **options: Any) -> int:
    """101 for a handshake that opens, else the refusal's status."""
    try:
        async with connect(url, open_timeout=TIMEOUT_S, **options):
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


def test_a_browser_page_of_another_site_is_refused(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        host = f"127.0.0.1:{server.port}"
        assert await status_of(server.url, origin="http://evil.example") == 403
        assert await status_of(server.url, origin=f"http://{host}") == 101
        assert await status_of(server.url, origin=f"https://{host}") == 101
        assert await status_of(server.url) == 101  # not a browser: no Origin

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_allowed_origins_add_to_the_gateways_own(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert await status_of(server.url, origin="https://chat.example") == 101
        # The gateway's own pages (chat, dashboard) keep working.
        assert await status_of(server.url, origin=f"http://127.0.0.1:{server.port}") == 101
        assert await status_of(server.url, origin="https://evil.example") == 403

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        allowed_origins=("https://chat.example",),
    )


def test_keys_that_go_away_never_open_the_gateway(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tmp_path: Path,
) -> None:
    tenants_file = tmp_path / "tenants.toml"
    write_tenants(tenants_file, KEY)

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert await status_of(server.url) == 401
        write_tenants(tenants_file)  # every key gone
        server.request_tenants_reload()
        deadline_s = time.monotonic() + TIMEOUT_S
        while await status_of(server.url, additional_headers=bearer(KEY)) == 101:
            assert time.monotonic() < deadline_s
            await asyncio.sleep(0.05)
        assert await status_of(server.url) == 401

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        tenants_file=tenants_file,
        tenants_reload_s=0.1,
    )


def test_open_serves_keyless_clients_besides_the_keys(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tmp_path: Path,
) -> None:
    tenants_file = tmp_path / "tenants.toml"
    write_tenants(tenants_file, KEY)

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            await accept(socket, "q")
            assert (await upstream.next_submit()).tenant == "default"
        async with connect(server.url, additional_headers=bearer(KEY)) as socket:
            await accept(socket, "q")
            assert (await upstream.next_submit()).tenant == "t0"
        assert await status_of(server.url, additional_headers=bearer("opk_wrong")) == 401

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file, open=True
    )


def test_a_revoked_key_closes_its_sockets(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tmp_path: Path,
) -> None:
    tenants_file = tmp_path / "tenants.toml"
    write_tenants(tenants_file, KEY, OTHER_KEY)
    reload_s = 0.2

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with (
            connect(server.url, additional_headers=bearer(KEY)) as doomed,
            connect(server.url, additional_headers=bearer(OTHER_KEY)) as kept,
        ):
            await accept(doomed, "q")
            write_tenants(tenants_file, OTHER_KEY)
            started_s = time.monotonic()
            await asyncio.wait_for(doomed.wait_closed(), TIMEOUT_S)
            assert time.monotonic() - started_s < reload_s + 2.0
            assert doomed.close_code == POLICY_VIOLATION
            assert doomed.close_reason == REVOKED_REASON
            # The other key's socket is untouched and still served.
            await accept(kept, "q")
            assert kept.close_code is None

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        tenants_file=tenants_file,
        tenants_reload_s=reload_s,
    )


async def raw_status(port: int, request_head: str, body: bytes = b"") -> int:
    """The status of one HTTP/1.1 request sent as written (headers repeated,
    any ``Host``), as a rebinding page's browser or a hostile client sends it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        status_line = await asyncio.wait_for(reader.readline(), TIMEOUT_S)
        return int(status_line.split()[1])
    finally:
        writer.close()


WS_HEAD = (
    "GET /ws HTTP/1.1\nUpgrade: websocket\nConnection: Upgrade\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\nSec-WebSocket-Version: 13\n"
)


def rebound(host: str) -> str:
    """The headers a page on ``host`` sends once ``host`` resolves to us."""
    return f"Host: {host}\nOrigin: http://{host}\n"


def test_a_rebound_name_is_refused_on_a_keyless_gateway(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    """DNS rebinding: a page on attacker.example, whose name now resolves to
    127.0.0.1, is same-origin with it; every route refuses its Host."""

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert server.port is not None
        port = server.port
        attacker = rebound(f"attacker.example:{port}")
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        post = f"POST /v1/chat/completions HTTP/1.1\nContent-Length: {len(body)}\n"
        assert await raw_status(port, WS_HEAD + attacker) == 403
        assert await raw_status(port, WS_HEAD.replace("/ws", "/dashboard/ws") + attacker) == 403
        assert await raw_status(port, "GET /v1/models HTTP/1.1\n" + attacker) == 403
        assert await raw_status(port, "GET /metrics HTTP/1.1\n" + attacker) == 403
        json_post = post + "Content-Type: application/json\n" + attacker
        assert await raw_status(port, json_post, body) == 403
        # The names nobody outside controls pass: IP literals, localhost, ours.
        for name in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "app.localhost"):
            assert await raw_status(port, WS_HEAD + rebound(name)) == 101, name
        assert await raw_status(port, "GET /v1/models HTTP/1.1\nHost: localhost\n") == 200
        assert await upstream.redis.xlen(KEYS.requests) == 0

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_allowed_hosts_are_answered_and_checked_with_keys_too(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tmp_path: Path,
) -> None:
    tenants_file = tmp_path / "tenants.toml"
    write_tenants(tenants_file, KEY)

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert server.port is not None
        key = f"Authorization: Bearer {KEY}\n"
        assert await raw_status(server.port, WS_HEAD + key + rebound("llm.example")) == 101
        assert await raw_status(server.port, WS_HEAD + key + rebound("other.example")) == 403

    run_with_gateway(
        redis_server,
        chat_tokenizer,
        model_limits,
        scenario,
        tenants_file=tenants_file,
        allowed_hosts=("llm.example",),
    )


def test_a_gateway_with_keys_answers_any_name_by_default(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tmp_path: Path,
) -> None:
    """Behind a load balancer or in a compose network clients use names
    nobody listed; a rebound page has no key to use."""
    tenants_file = tmp_path / "tenants.toml"
    write_tenants(tenants_file, KEY)

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert server.port is not None
        key = f"Authorization: Bearer {KEY}\n"
        assert await raw_status(server.port, WS_HEAD + key + rebound("gateway-0:8000")) == 101
        assert await raw_status(server.port, WS_HEAD + rebound("attacker.example")) == 401

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file
    )


def test_a_repeated_credential_or_origin_header_is_a_400(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert server.port is not None
        port = server.port
        host = f"Host: 127.0.0.1:{port}\n"
        twice = {
            "Authorization": "Authorization: Bearer a\nAuthorization: Bearer b\n",
            "Origin": f"Origin: http://127.0.0.1:{port}\nOrigin: http://evil.example\n",
            "Host": f"{host}Host: attacker.example\n",
        }
        for name, headers in twice.items():
            assert await raw_status(port, WS_HEAD + host * (name != "Host") + headers) == 400
            models = "GET /v1/models HTTP/1.1\n" + host * (name != "Host") + headers
            assert await raw_status(port, models) == 400, name

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(autouse=True)
def _no_tenants_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCAPOD_TENANTS_FILE", raising=False)
