"""`orcapod up` and API keys: without any, loopback only (checked before anything starts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from gateway.tenants import Tenant, UnprotectedHostError, hash_key, parse_tenants_toml
from orcapod import up
from shared.messages import encode
from tests.conftest import RedisServer


def test_exposure_line_refuses_a_public_host_without_keys() -> None:
    for host in ("127.0.0.1", "localhost", "::1"):
        assert up.exposure_line(host, 0) == (
            "no API keys configured: one open tenant, listening on loopback only"
        )
    for host in ("0.0.0.0", "192.168.1.10", "myhost"):
        with pytest.raises(UnprotectedHostError, match=f"--host {host} without any API key"):
            up.exposure_line(host, 0)
    assert up.exposure_line("0.0.0.0", 2) == "API keys required (2 configured)"


def test_up_refuses_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("ORCAPOD_TENANTS_FILE", raising=False)

    def no_model(_model_arg: str | None) -> str:
        raise AssertionError("the model must not be touched when the arguments are refused")

    monkeypatch.setattr(up, "_ensure_model", no_model)
    assert up.main(["--host", "0.0.0.0"]) == 2
    assert "without any API key" in capsys.readouterr().err
    broken = tmp_path / "broken.toml"
    broken.write_text("[tenants.a\n")
    assert up.main(["--host", "127.0.0.1", "--tenants-file", str(broken)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert up.main(["--tenants-file", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_keys_in_the_tenants_file_count(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.a]\nkey_sha256 = ["{hash_key("k")}"]\n')
    assert up._num_keys("0.0.0.0", path, None) == 1
    assert parse_tenants_toml(path.read_text()).lookup("k") is not None
    assert up._num_keys("0.0.0.0", None, None) == 0


def test_keys_in_an_external_redis_count(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCAPOD_PREFIX", "uptest")
    assert up._num_keys("0.0.0.0", None, redis_server.url) == 0
    with redis.Redis.from_url(redis_server.url) as client:
        client.hset("uptest:tenants", hash_key("k"), encode(Tenant(name="a")))
    assert up._num_keys("0.0.0.0", None, redis_server.url) == 1
    # On loopback the count does not matter, and Redis is not asked.
    assert up._num_keys("127.0.0.1", None, "redis://127.0.0.1:1/0") == 0
