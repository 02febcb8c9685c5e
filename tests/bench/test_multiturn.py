"""The pure parts of the multi-turn benchmark (``orcapod.bench.multiturn``): the trace,
the streamed answer's parsing, and the summaries (the runs themselves are by hand)."""

from __future__ import annotations

import json

import pytest

from orcapod.bench.loadgen import LoadError
from orcapod.bench.multiturn import (
    check_http_loopback,
    http_base_url,
)
from orcapod.bench.multiturn_report import (
    TurnRecord,
    TurnStream,
    cache_counters,
    hit_rate,
    prompt_counts,
    service_cache,
    summarize_run,
    summarize_turns,
    turn_entry,
    turn_table,
    verdicts,
)
from orcapod.bench.multiturn_trace import (
    Conversation,
    MultiturnSpec,
    make_multiturn_trace,
)
from orcapod.bench.multiturn_trace import turn_messages as messages_of


def _record(
    turn: int,
    ttft_s: float | None,
    prompt: int | None = 100,
    cached: int | None = 0,
    conversation: int = 0,
    error: str | None = None,
    completion: int = 8,
) -> TurnRecord:
    prefill = None if prompt is None or cached is None else prompt - cached
    finish = None if error else "length"
    return TurnRecord(conversation, turn, 0.0, ttft_s, 1.0, prompt, cached, prefill, completion,
                      finish, error)  # fmt: skip


# --- the trace ------------------------------------------------------------------------


def test_the_same_spec_gives_the_same_trace_and_another_seed_another() -> None:
    spec = MultiturnSpec(num_conversations=4, num_turns=5, seed=3)

    assert make_multiturn_trace(spec) == make_multiturn_trace(spec)
    other = make_multiturn_trace(MultiturnSpec(num_conversations=4, num_turns=5, seed=4))
    assert other.conversations != make_multiturn_trace(spec).conversations


def test_every_conversation_has_its_turns_and_no_user_message_repeats() -> None:
    trace = make_multiturn_trace(MultiturnSpec(num_conversations=30, num_turns=20))

    assert [c.index for c in trace.conversations] == list(range(30))
    assert all(len(c.user_messages) == 20 for c in trace.conversations)
    messages = [m for c in trace.conversations for m in c.user_messages]
    assert len(set(messages)) == len(messages)


def test_every_conversation_starts_with_the_one_system_prompt() -> None:
    trace = make_multiturn_trace(MultiturnSpec(num_conversations=3, num_turns=2))

    firsts = [messages_of(trace.system_prompt, c, [])[0] for c in trace.conversations]

    assert firsts == [{"role": "system", "content": trace.system_prompt}] * 3
    assert len(trace.system_prompt.split()) > 250  # a prompt worth caching (~440 tokens)


def test_each_turn_is_the_previous_turn_plus_its_answer_plus_a_new_user_message() -> None:
    conversation = Conversation(0, ("first?", "second?", "third?"))
    answers = ["one", "two"]

    turns = [messages_of("sys", conversation, answers[:turn]) for turn in range(3)]

    assert turns[0] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "first?"}]
    for turn in (1, 2):
        assert turns[turn] == [
            *turns[turn - 1],
            {"role": "assistant", "content": answers[turn - 1]},
            {"role": "user", "content": conversation.user_messages[turn]},
        ]
    with pytest.raises(ValueError):
        messages_of("sys", conversation, ["one", "two", "three"])


def test_a_spec_needs_at_least_one_of_everything() -> None:
    with pytest.raises(ValueError):
        MultiturnSpec(num_conversations=0)
    with pytest.raises(ValueError):
        MultiturnSpec(max_tokens=0)


# --- one streamed answer ----------------------------------------------------------------


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n"


def _chunk(content: str | None = None, finish: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}


def test_an_orcapod_stream_gives_ttft_text_and_prefill_from_cached_tokens() -> None:
    stream = TurnStream(sent_s=10.0)
    usage = {"prompt_tokens": 500, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 464}}  # fmt: skip
    lines = [
        _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        b"\n",
        _sse(_chunk("Hel")),
        _sse(_chunk("lo")),
        _sse(_chunk(finish="length")),
        _sse({"choices": [], "usage": usage}),
        b"data: [DONE]\n",
    ]
    for now_s, line in enumerate(lines, start=11):
        stream.feed(line, float(now_s))

    record = stream.record(conversation=2, turn=3, ended_s=20.0)

    assert stream.done and stream.text == "Hello"
    assert record.ttft_s == 3.0  # the first non-empty content, not the role chunk
    assert (record.conversation, record.turn, record.latency_s) == (2, 3, 10.0)
    assert (record.num_prompt_tokens, record.num_cached_tokens) == (500, 464)
    assert (record.num_prefill_tokens, record.num_completion_tokens) == (36, 2)
    assert record.completed


def test_llama_server_timings_say_what_was_computed() -> None:
    usage = {"prompt_tokens": 35, "completion_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 34}}  # fmt: skip

    assert prompt_counts(usage, {"prompt_n": 1, "cache_n": 34}) == (35, 34, 1)
    assert prompt_counts({"prompt_tokens": 35}, {"prompt_n": 5, "cache_n": 30}) == (35, 30, 5)
    assert prompt_counts({"prompt_tokens": 35}, None) == (35, None, None)
    assert prompt_counts(None, None) == (None, None, None)


def test_an_error_event_or_a_missing_finish_ends_the_turn_with_an_error() -> None:
    stream = TurnStream(sent_s=0.0)
    stream.feed(_sse(_chunk("a")), 1.0)
    stream.feed(_sse({"error": {"message": "the worker was lost", "type": "server_error"}}), 2.0)
    stream.feed(_sse(_chunk("b", finish="stop")), 3.0)  # after the end: ignored

    record = stream.record(0, 1, 3.0)

    assert record.error == "the worker was lost" and not record.completed
    assert stream.text == "a"
    cut = TurnStream(sent_s=0.0)
    cut.feed(_sse(_chunk("a")), 1.0)
    assert cut.record(0, 1, 2.0).error is not None


# --- summaries --------------------------------------------------------------------------


def test_per_turn_medians_leave_failed_turns_out() -> None:
    records = [
        _record(1, 0.2, prompt=460, cached=448, conversation=0),
        _record(1, 0.4, prompt=470, cached=448, conversation=1),
        _record(1, 0.9, prompt=480, cached=448, conversation=2),
        _record(2, 0.3, prompt=520, cached=496, conversation=0),
        _record(2, None, prompt=None, cached=None, conversation=1, error="HTTP 503"),
    ]

    turns = summarize_turns(records)

    assert [(t.turn, t.num_completed) for t in turns] == [(1, 3), (2, 1)]
    assert (turns[0].ttft_p50_s, turns[0].prompt_tokens_p50) == (0.4, 470.0)
    assert (turns[0].cached_tokens_p50, turns[0].prefill_tokens_p50) == (448.0, 22.0)
    assert (turns[1].ttft_p50_s, turns[1].prefill_tokens_p50) == (0.3, 24.0)


def test_hit_rate_is_cached_over_prompt_tokens_of_the_turns_that_report_both() -> None:
    records = [
        _record(1, 0.1, prompt=400, cached=300),
        _record(2, 0.1, prompt=600, cached=600),
        _record(3, 0.1, prompt=1000, cached=None),  # no cache count: left out
        _record(4, None, prompt=None, cached=None, error="timeout"),
    ]

    assert hit_rate(records) == pytest.approx(0.9)
    assert hit_rate([_record(1, 0.1, cached=None)]) is None
    assert hit_rate([]) is None


def test_a_run_summary_has_throughput_hit_rate_and_ttft_growth() -> None:
    records = [
        _record(1, 0.2, prompt=100, cached=0, completion=10),
        _record(2, 0.3, prompt=200, cached=150, completion=10),
        _record(2, None, prompt=None, cached=None, error="HTTP 500", conversation=1),
    ]

    summary = summarize_run(records, wall_s=4.0)

    assert (summary["num_sent"], summary["num_completed"], summary["num_errors"]) == (3, 2, 1)
    assert (summary["turns_per_s"], summary["output_tok_s"]) == (0.5, 5.0)
    assert summary["hit_rate"] == pytest.approx(0.5)
    assert summary["prefill_tokens_total"] == 150
    assert summary["ttft_last_over_first"] == pytest.approx(1.5)
    assert turn_entry(summary, 2)["prefill_tokens_p50"] == 50.0
    assert turn_entry(summary, 3) is None


def _summary(by_turn: dict[int, tuple[float, float]], rate: float | None = 0.9) -> dict:
    entries = [
        {"turn": turn, "ttft_p50_s": ttft, "prefill_tokens_p50": prefill}
        for turn, (ttft, prefill) in by_turn.items()
    ]
    return {"by_turn": entries, "hit_rate": rate}


def test_verdicts_judge_turn_8_against_turn_1_and_against_the_cache_off() -> None:
    on = _summary({1: (0.2, 30.0), 8: (0.28, 60.0), 9: (5.0, 60.0)})
    off = _summary({1: (0.3, 470.0), 8: (1.2, 900.0)}, rate=0.0)

    lines = verdicts(on, off, _summary({}, 0.9), _summary({}, 0.6))

    assert [line.split()[0] for line in lines] == ["PASS", "PASS", "hit"]  # turn 9 not judged
    slow = verdicts(_summary({1: (0.2, 30.0), 8: (0.4, 200.0)}), off)
    assert [line.split()[0] for line in slow] == ["MISS", "MISS"]
    short = verdicts(_summary({1: (0.2, 30.0), 3: (0.25, 40.0)}))
    assert len(short) == 1 and "turn 3" in short[0]  # fewer turns: the last one


def test_the_turn_table_has_a_row_per_turn_and_a_dash_where_a_run_has_none() -> None:
    text = turn_table(
        {"a": _summary({1: (0.2, 30.0), 2: (0.3, 40.0)}), "b": _summary({1: (1.0, 470.0)})}
    )
    rows = [row.strip("|").split("|") for row in text.splitlines()[2:]]

    assert [[cell.strip() for cell in row] for row in rows] == [
        ["1", "0.20", "30", "1.00", "470"],
        ["2", "0.30", "40", "-", "-"],
    ]


def test_service_hit_rate_from_the_counters_deltas() -> None:
    before = cache_counters({b"num_queries": b"2", b"num_query_tokens": b"900"})
    after = cache_counters({b"num_queries": b"10", b"num_query_tokens": b"4900",
                            b"num_hit_tokens": b"3000", b"num_hits": b"7"})  # fmt: skip

    delta = service_cache(before, after)

    assert (delta["num_queries"], delta["num_hits"], delta["num_evictions"]) == (8, 7, 0)
    assert delta["hit_rate"] == pytest.approx(0.75)
    assert service_cache(before, before)["hit_rate"] is None


def test_urls_stay_on_loopback() -> None:
    assert http_base_url("ws://127.0.0.1:8000/ws") == "http://127.0.0.1:8000"
    check_http_loopback("http://127.0.0.1:8080/v1")
    for url in ("http://example.com:8080", "ws://127.0.0.1:8000/ws"):
        with pytest.raises(LoadError):
            check_http_loopback(url)
