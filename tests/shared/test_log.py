"""Log lines of processes that share one stderr (a worker group's ranks, started
together, log at the same moment) stay whole: each line goes out in one write,
newline included, so none lands inside another's."""

from __future__ import annotations

import json

import pytest
import structlog

from shared.log import configure_logging


class _Writes:
    """A stderr that records each write call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_each_log_line_is_one_write_newline_included(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = _Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    before = structlog.get_config()
    try:
        log = configure_logging("worker")
        log.info("group_rank_joined", rank=0)
        log.warning("weights_not_packed", reason="a\nb")
    finally:
        structlog.configure(**before)
    assert len(stderr.calls) == 2
    assert all(call.endswith("\n") and call.count("\n") == 1 for call in stderr.calls)
    assert [json.loads(call)["event"] for call in stderr.calls] == [
        "group_rank_joined",
        "weights_not_packed",
    ]
