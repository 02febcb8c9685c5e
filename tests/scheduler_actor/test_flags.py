"""The scheduler's limits are refused at start, as a usage error naming the flag,
when they are not integers of at least 1 (not a traceback after Redis answers)."""

from __future__ import annotations

import pytest

from scheduler_actor.__main__ import parse_settings

LIMITS = ["--max-batch-size", "--token-budget", "--max-chunk-tokens", "--pipeline-token-budget"]


@pytest.mark.parametrize("flag", LIMITS)
@pytest.mark.parametrize("value", ["0", "-1", "1.5", "many", "", "nan"])
def test_a_limit_below_one_or_not_an_integer_is_a_usage_error(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_settings([f"{flag}={value}"])
    assert stopped.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_the_limits_are_read_from_their_flags() -> None:
    settings = parse_settings(
        ["--max-batch-size=8", "--token-budget=256", "--max-chunk-tokens=128",
         "--pipeline-token-budget=32"]
    )  # fmt: skip
    assert (settings.max_batch_size, settings.token_budget) == (8, 256)
    assert (settings.max_chunk_tokens, settings.pipeline_token_budget) == (128, 32)
    assert parse_settings([]).pipeline_token_budget == 64
