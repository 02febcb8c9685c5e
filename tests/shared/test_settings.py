"""Settings every actor and client reads: API keys of clients, the log retention."""

from __future__ import annotations

from shared.settings import (
    DEFAULT_LOG_RETENTION_S,
    auth_headers,
    client_api_key,
    redis_settings,
)


def test_the_flag_wins_then_the_environment_then_none() -> None:
    assert client_api_key("flag-key", {"ORCAPOD_API_KEY": "env-key"}) == "flag-key"
    assert client_api_key(None, {"ORCAPOD_API_KEY": "env-key"}) == "env-key"
    assert client_api_key(None, {"ORCAPOD_API_KEY": ""}) is None
    assert client_api_key(None, {}) is None


def test_a_key_travels_as_a_bearer_token() -> None:
    assert auth_headers("k") == {"Authorization": "Bearer k"}
    assert auth_headers(None) == {}


def test_the_log_retention_comes_from_the_flag_then_the_environment() -> None:
    assert redis_settings(environ={}).log_retention_s == DEFAULT_LOG_RETENTION_S
    env = {"ORCAPOD_LOG_RETENTION_S": "60"}
    assert redis_settings(environ=env).log_retention_s == 60
    assert redis_settings(environ=env, log_retention_s=5).log_retention_s == 5
