"""How `orcapod chat` and `orcapod bench` carry an API key."""

from __future__ import annotations

from shared.settings import auth_headers, client_api_key


def test_the_flag_wins_then_the_environment_then_none() -> None:
    assert client_api_key("flag-key", {"ORCAPOD_API_KEY": "env-key"}) == "flag-key"
    assert client_api_key(None, {"ORCAPOD_API_KEY": "env-key"}) == "env-key"
    assert client_api_key(None, {"ORCAPOD_API_KEY": ""}) is None
    assert client_api_key(None, {}) is None


def test_a_key_travels_as_a_bearer_token() -> None:
    assert auth_headers("k") == {"Authorization": "Bearer k"}
    assert auth_headers(None) == {}
