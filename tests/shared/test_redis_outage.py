"""The outage clock behind ``watch_redis`` and the ``--redis-outage-limit-s`` flag,
and the watch itself against a real redis-server that goes away."""

from __future__ import annotations

import argparse
import asyncio
import math
import time

import pytest

from shared.redis_outage import OutageClock, RedisGoneError, watch_redis
from shared.settings import add_redis_arguments, redis_settings, redis_settings_from_args
from tests.conftest import free_port


def test_the_limit_counts_from_the_first_unanswered_probe_and_an_answer_resets_it() -> None:
    clock = OutageClock(limit_s=3.0)
    assert not clock.unanswered(10.0)
    assert not clock.unanswered(12.9)
    clock.answered()
    assert clock.outage_s(13.0) == 0.0
    assert not clock.unanswered(14.0)
    assert not clock.unanswered(16.9)
    assert clock.unanswered(17.0)
    assert clock.outage_s(17.5) == 3.5


@pytest.mark.parametrize("limit_s", [0.0, -1.0, math.nan])
def test_a_clock_needs_a_positive_limit(limit_s: float) -> None:
    with pytest.raises(ValueError, match="outage limit"):
        OutageClock(limit_s)


def _parse(*argv: str) -> float:
    parser = argparse.ArgumentParser()
    add_redis_arguments(parser)
    return redis_settings_from_args(parser.parse_args(argv)).outage_limit_s


def test_the_flag_then_the_environment_then_five_minutes(monkeypatch) -> None:
    monkeypatch.delenv("ORCAPOD_REDIS_OUTAGE_LIMIT_S", raising=False)
    assert _parse() == 300.0
    assert _parse("--redis-outage-limit-s", "0") == 0.0  # never stop
    monkeypatch.setenv("ORCAPOD_REDIS_OUTAGE_LIMIT_S", "12.5")
    assert _parse() == 12.5
    assert _parse("--redis-outage-limit-s", "7") == 7.0


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "1e999", "soon", ""])
def test_a_bad_flag_is_a_usage_error(text: str, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        _parse("--redis-outage-limit-s", text)
    assert stopped.value.code == 2
    assert "--redis-outage-limit-s" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["-1", "nan", "inf"])
def test_a_bad_environment_value_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="outage limit"):
        redis_settings(environ={"ORCAPOD_REDIS_OUTAGE_LIMIT_S": text})


def test_the_watch_gives_up_on_a_redis_that_never_answers() -> None:
    """Nothing listens on the port: the watch raises after its limit, not before."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(RedisGoneError, match="has not answered"):
        asyncio.run(asyncio.wait_for(watch_redis(url, limit_s=1.5), timeout=15))
    assert time.monotonic() - started >= 1.5


def test_the_watch_keeps_quiet_while_redis_answers(redis_server) -> None:
    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watch_redis(redis_server.url, limit_s=0.5), timeout=2.5)

    asyncio.run(main())
