"""Tenants and API keys: parsing, lookup, the handshake's decision, reloading from a
file and a real Redis hash, and the `orcapod tenants` command."""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from gateway import tenants_cli
from gateway.handshake import AuthError, authenticate, presented_key
from gateway.tenant_loader import TenantLoader
from gateway.tenants import (
    OPEN_TENANT,
    Tenant,
    TenantConfigError,
    TokenReservation,
    hash_key,
    is_loopback_host,
    over_tokens_per_minute,
    parse_tenants_toml,
    tenant_toml,
    tokens_window,
)
from shared.keys import RedisKeys
from shared.messages import TenantLimits, encode
from tests.conftest import RedisServer

KEY_A = "key-of-acme"
KEY_B = "key-of-beta"
KEYS = RedisKeys("tenants-test")

EXAMPLE = f"""
[tenants.acme]
weight = 2.0
max_queued = 100
max_in_flight = 8
max_tokens_per_request = 1024
tokens_per_minute = 200000
cache_group = "acme-apps"
operator = true
key_sha256 = ["{hash_key(KEY_A)}"]

[tenants.beta]
key_sha256 = ["{hash_key(KEY_B).upper()}"]
"""


def test_hash_is_the_sha256_hex_of_the_key() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_parse_and_look_up_by_key() -> None:
    table = parse_tenants_toml(EXAMPLE)
    assert table.num_keys == 2
    acme = table.lookup(KEY_A)
    assert acme == Tenant(
        name="acme",
        weight=2.0,
        max_queued=100,
        max_in_flight=8,
        max_tokens_per_request=1024,
        tokens_per_minute=200_000,
        cache_group="acme-apps",
        operator=True,
    )
    assert acme.limits == TenantLimits(
        weight=2.0, max_queued=100, max_in_flight=8, cache_group="acme-apps"
    )
    beta = table.lookup(KEY_B)  # its hash was written in upper case
    assert beta == Tenant(name="beta") and beta.limits == TenantLimits()
    assert table.lookup("key-of-nobody") is None
    assert table.lookup(hash_key(KEY_A)) is None  # the hash itself is not a key
    assert parse_tenants_toml("").num_keys == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[tenants.acme\nweight = 1", "not valid TOML"),
        ("[tenants.acme]\nwieght = 2.0", "unknown field `wieght`"),
        ("[tenants.acme]\nweight = 0", "Expected `float` > 0.0"),
        ("[tenants.acme]\nmax_in_flight = 0", "max_in_flight"),
        ("[tenants.acme]\ntokens_per_minute = 'lots'", "tokens_per_minute"),
        (f'[tenants.acme]\nkey_sha256 = ["{KEY_A}"]', "orcapod tenants hash-key"),
        ("[tenants.'a b']\n", "matching regex"),
        ("[tenant.acme]\n", "unknown field `tenant`"),
        (
            f'[tenants.a]\nkey_sha256 = ["{hash_key(KEY_A)}"]\n'
            f'[tenants.b]\nkey_sha256 = ["{hash_key(KEY_A)}"]',
            "listed for both 'a' and 'b'",
        ),
    ],
)
def test_bad_files_are_clear_errors(text: str, expected: str) -> None:
    with pytest.raises(TenantConfigError) as caught:
        parse_tenants_toml(text, source="tenants.toml")
    assert str(caught.value).startswith("tenants.toml: ") and expected in str(caught.value)


def test_toml_section_round_trips() -> None:
    tenant = Tenant(
        name="acme",
        weight=0.5,
        max_in_flight=3,
        tokens_per_minute=9000,
        operator=True,
        cache_group="shared",
    )
    table = parse_tenants_toml(tenant_toml(tenant, [hash_key(KEY_A), hash_key(KEY_B)]))
    assert table.lookup(KEY_A) == tenant and table.lookup(KEY_B) == tenant


def test_presented_key_from_either_header() -> None:
    assert presented_key("Bearer abc", []) == "abc"
    assert presented_key("bearer  abc ", []) == "abc"
    assert presented_key("Basic abc", []) is None
    assert presented_key("Bearer ", []) is None
    assert presented_key(None, ["orcapod", "bearer.abc"]) == "abc"
    assert presented_key(None, ["orcapod"]) is None
    # The header wins over the subprotocol.
    assert presented_key("Bearer one", ["bearer.two"]) == "one"


def test_authenticate_decides_the_handshake() -> None:
    table = parse_tenants_toml(EXAMPLE)
    empty = parse_tenants_toml("")
    assert OPEN_TENANT.name == "default"
    # Open (decided at start): keyless clients are the open tenant; a key is
    # ignored while none is configured, checked once some are.
    assert authenticate(empty, None, open_tenant=OPEN_TENANT) is OPEN_TENANT
    assert authenticate(empty, "any", open_tenant=OPEN_TENANT) is OPEN_TENANT
    assert authenticate(table, None, open_tenant=OPEN_TENANT) is OPEN_TENANT
    with pytest.raises(AuthError, match="invalid API key"):
        authenticate(table, "wrong", open_tenant=OPEN_TENANT)
    # Not open: a table whose keys all went away refuses everyone.
    with pytest.raises(AuthError, match="missing API key"):
        authenticate(empty, None, open_tenant=None)
    with pytest.raises(AuthError, match="invalid API key"):
        authenticate(empty, KEY_A, open_tenant=None)
    with pytest.raises(AuthError, match="missing API key"):
        authenticate(table, None, open_tenant=None)
    assert authenticate(table, KEY_A, open_tenant=None).name == "acme"


def test_loopback_hosts() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert is_loopback_host(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.1", "example.com"):
        assert not is_loopback_host(host), host


def test_tokens_window_and_message() -> None:
    assert tokens_window(120.0) == (2, 60.0)
    index, retry_in_s = tokens_window(179.25)
    assert index == 2 and retry_in_s == pytest.approx(0.75)
    message = over_tokens_per_minute(TokenReservation("acme", 300, 1000), 900, 41.6)
    assert "tokens-per-minute limit (1000" in message and "retry in 42 s" in message


# --- the loader: a real file, a real Redis ---------------------------------------------


def _write(path: Path, text: str, mtime_s: float) -> None:
    path.write_text(text, encoding="utf-8")
    # Explicit mtimes: two writes within one clock tick must still differ.
    os.utime(path, (mtime_s, mtime_s))


def _run(coroutine_factory, redis_server: RedisServer):
    async def main():
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            return await coroutine_factory(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_file_reload_on_mtime_change_keeps_the_old_table_when_broken(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    path = tmp_path / "tenants.toml"
    _write(path, EXAMPLE, 1_000)

    async def scenario(client: aioredis.Redis) -> None:
        loader = TenantLoader(path, client, KEYS.tenants)
        table = await loader.load()
        assert table.lookup(KEY_A) is not None and table.num_keys == 2
        assert not await loader.reload()  # unchanged
        _write(path, f'[tenants.acme]\nkey_sha256 = ["{hash_key("new-key")}"]\n', 2_000)
        assert await loader.reload()
        assert loader.table.lookup("new-key") == Tenant(name="acme")
        assert loader.table.lookup(KEY_A) is None
        _write(path, "[tenants.acme\nbroken", 3_000)
        assert not await loader.reload()
        assert loader.table.lookup("new-key") is not None, "a broken file keeps the old table"
        path.unlink()
        assert not await loader.reload()
        assert loader.table.lookup("new-key") is not None, "so does a missing one"
        _write(path, EXAMPLE, 4_000)
        assert await loader.reload()
        assert loader.table.lookup(KEY_B) is not None

    _run(scenario, redis_server)


def test_a_broken_or_missing_file_at_start_is_an_error(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    path = tmp_path / "tenants.toml"

    async def scenario(client: aioredis.Redis) -> None:
        with pytest.raises(TenantConfigError, match="cannot read"):
            await TenantLoader(path, client, KEYS.tenants).load()
        _write(path, "weight = 1", 1_000)
        with pytest.raises(TenantConfigError, match="unknown field `weight`"):
            await TenantLoader(path, client, KEYS.tenants).load()

    _run(scenario, redis_server)


def test_redis_hash_source_merges_under_the_file(tmp_path: Path, redis_server: RedisServer) -> None:
    path = tmp_path / "tenants.toml"
    _write(path, EXAMPLE, 1_000)

    async def scenario(client: aioredis.Redis) -> None:
        await client.hset(
            KEYS.tenants,
            mapping={
                hash_key("redis-key"): encode(Tenant(name="gamma", max_in_flight=2)),
                # The file's tenant wins for a key in both.
                hash_key(KEY_A): encode(Tenant(name="impostor")),
                hash_key("bad-record"): b"\x00 not msgpack",
                "not-a-hash": encode(Tenant(name="gamma")),
            },
        )
        loader = TenantLoader(path, client, KEYS.tenants)
        table = await loader.load()
        assert table.lookup("redis-key") == Tenant(name="gamma", max_in_flight=2)
        assert table.lookup(KEY_A) is not None and table.lookup(KEY_A).name == "acme"
        assert table.lookup("bad-record") is None
        assert table.num_keys == 3
        await client.hdel(KEYS.tenants, hash_key("redis-key"))
        assert await loader.reload()
        assert loader.table.lookup("redis-key") is None
        # Redis gone: the keys it had stay.
        await client.hset(KEYS.tenants, hash_key("late-key"), encode(Tenant(name="gamma")))
        assert await loader.reload()
        redis_server.process.terminate()
        redis_server.process.wait()
        assert not await loader.reload()
        assert loader.table.lookup("late-key") is not None

    _run(scenario, redis_server)


# --- `orcapod tenants` -----------------------------------------------------------------


def test_cli_hash_key(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("abc\n"))
    assert tenants_cli.main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("abc")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert tenants_cli.main(["hash-key"]) == 2


def test_cli_add_key_to_redis_then_list_and_revoke(
    redis_server: RedisServer, capsys: pytest.CaptureFixture
) -> None:
    redis_args = ["--redis-url", redis_server.url, "--prefix", KEYS.prefix]
    assert (
        tenants_cli.main(["add-key", "--tenant", "acme", "--max-in-flight", "4", *redis_args]) == 0
    )
    again = ["add-key", "--tenant", "acme", "--weight", "3", "--cache-group", "g1"]
    assert tenants_cli.main([*again, *redis_args]) == 0
    key_1, key_2 = capsys.readouterr().out.split()
    assert key_1 != key_2 and key_1.startswith("opk_")

    async def scenario(client: aioredis.Redis):
        return await TenantLoader(None, client, KEYS.tenants).load()

    table = _run(scenario, redis_server)
    # The second call kept max_in_flight and set the weight of both keys.
    expected = Tenant(name="acme", weight=3.0, max_in_flight=4, cache_group="g1")
    assert table.lookup(key_1) == expected and table.lookup(key_2) == expected
    assert tenants_cli.main(["list", *redis_args]) == 0
    listing = capsys.readouterr().out
    assert hash_key(key_1) in listing and "max_in_flight=4" in listing and key_1 not in listing
    assert tenants_cli.main(["revoke", hash_key(key_1), *redis_args]) == 0
    assert tenants_cli.main(["revoke", hash_key(key_1), *redis_args]) == 1
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.hkeys(KEYS.tenants) == [hash_key(key_2).encode()]
    assert tenants_cli.main(["add-key", "--tenant", "bad name", *redis_args]) == 2
    assert tenants_cli.main(["add-key", "--tenant", "t", "--weight", "0", *redis_args]) == 2


def test_cli_add_key_as_toml(capsys: pytest.CaptureFixture) -> None:
    command = ["add-key", "--tenant", "acme", "--tokens-per-minute", "500", "--toml"]
    assert tenants_cli.main([*command, "--cache-group", "acme-apps"]) == 0
    out = capsys.readouterr().out
    key = out.splitlines()[0]
    section = out[out.index("[tenants.acme]") :]
    tenant = parse_tenants_toml(section).lookup(key)
    assert tenant == Tenant(name="acme", tokens_per_minute=500, cache_group="acme-apps")
    assert tenants_cli.main([*command, "--cache-group", "not a name"]) == 2
