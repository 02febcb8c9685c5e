"""The handshake, end to end: a page of another site is refused (403), the open
tenant is decided once at start, a revoked key closes its sockets (1008)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from gateway.server import REVOKED_REASON, GatewayServer
from gateway.tenants import Tenant, hash_key, tenant_toml
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from tests.conftest import RedisServer
from tests.gateway.test_server import (
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


def test_allowed_origins_replace_the_same_host_rule(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        assert await status_of(server.url, origin="https://chat.example") == 101
        assert await status_of(server.url, origin=f"http://127.0.0.1:{server.port}") == 403

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


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(autouse=True)
def _no_tenants_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCAPOD_TENANTS_FILE", raising=False)
