"""The pure parts of the Orca trace over the OpenAI API (``orcapod.bench.openai_trace``):
the streamed completion's parsing and the run's summary (the replays are by hand,
``bench/orca_peer.py``)."""

from __future__ import annotations

import json

import pytest

from orcapod.bench.openai_trace import CompletionRecord, _Stream, summarize


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n".encode()


def _record(index: int, arrival_s: float, end_s: float, tokens: int = 10, **kw) -> CompletionRecord:
    return CompletionRecord(index, arrival_s, 100, 10, arrival_s + 0.1, end_s, tokens, **kw)


def test_a_stream_counts_the_servers_usage_and_times_the_first_text() -> None:
    # orcapod: one chunk per token, then usage (stream_options.include_usage), then [DONE].
    stream = _Stream()
    stream.feed(_event({"choices": [{"text": ""}]}), 0.5)  # no text yet
    stream.feed(_event({"choices": [{"text": "a"}]}), 1.0)
    stream.feed(_event({"choices": [{"text": "bc"}]}), 1.5)
    stream.feed(b": keep-alive\n", 1.6)
    stream.feed(_event({"choices": [], "usage": {"completion_tokens": 3}}), 2.0)
    assert not stream.done
    stream.feed(b"data: [DONE]\n", 2.0)
    assert stream.done and stream.first_token_s == 1.0 and stream.tokens == 3


def test_without_usage_a_stream_counts_the_chunks_that_carried_text() -> None:
    stream = _Stream()
    for index in range(4):
        stream.feed(_event({"choices": [{"text": f"t{index}", "finish_reason": None}]}), index)
    stream.feed(b"data: [DONE]", 5.0)
    assert stream.tokens == 4 and stream.first_token_s == 0


def test_a_record_is_complete_only_with_all_its_tokens_and_no_error() -> None:
    assert _record(0, 0.0, 1.0).completed
    assert not _record(0, 0.0, 1.0, tokens=9).completed
    assert not _record(0, 0.0, 1.0, error="HTTP 503: busy").completed


def test_the_summary_is_completed_requests_over_first_arrival_to_last_answer() -> None:
    records = [
        _record(0, 0.0, 2.0),
        _record(1, 1.0, 4.0),
        _record(2, 2.0, 3.0, error="HTTP 500: boom"),
    ]
    summary = summarize(records, offered_rps=1.0)
    assert summary["completed"] == 2 and summary["requests"] == 3
    assert summary["span_s"] == pytest.approx(4.0)
    assert summary["completed_rps"] == pytest.approx(0.5)
    assert summary["output_tokens_per_s"] == pytest.approx(5.0)
    # Latency per generated token: 2.0 / 10 and 3.0 / 10.
    assert summary["normalized_latency_p50_s"] == pytest.approx(0.25)
    assert summary["ttft_p50_s"] == pytest.approx(0.1)
    assert summary["errors"] == ["HTTP 500: boom"]


def test_a_run_where_nothing_completed_says_so() -> None:
    summary = summarize([_record(0, 0.0, 1.0, error="refused")], offered_rps=2.0)
    assert summary == {"offered_rps": 2.0, "requests": 1, "completed": 0}
