"""Folding a request's log: each index once, the first token kept, the end respected."""

from __future__ import annotations

from shared.messages import (
    RequestEnded,
    RequestRecord,
    SampledToken,
    SamplingParams,
    SubmitRequest,
    TokenBatch,
)
from shared.request_log import RequestLog


def record(max_tokens: int = 5) -> RequestRecord:
    submit = SubmitRequest("r", "g", "t", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    return RequestRecord(submit=submit, client_id="c")


def batch(*tokens: tuple[int, int] | tuple[int, int, str]) -> TokenBatch:
    return TokenBatch(
        worker_id="w",
        tokens=[
            SampledToken("r", token_id, index, finish[0] if finish else None)  # type: ignore[arg-type]
            for index, token_id, *finish in tokens
        ],
    )


def test_a_recomputed_index_keeps_the_first_token_and_gaps_wait() -> None:
    log = RequestLog(record())
    log.fold(b"1-0", batch((0, 10)))
    log.fold(b"2-0", batch((1, 11)))
    log.fold(b"3-0", batch((1, 99)))  # sent again after a recompute
    log.fold(b"4-0", batch((3, 13)))  # beyond a gap: not contiguous, not taken
    assert log.token_ids == [10, 11]
    assert log.last_entry_id == b"4-0"
    assert not log.is_finished


def test_the_finish_reason_and_max_tokens_end_the_log() -> None:
    log = RequestLog(record(max_tokens=5))
    log.fold(b"1-0", batch((0, 10), (1, 11, "stop")))
    log.fold(b"2-0", batch((2, 12)))
    assert log.token_ids == [10, 11] and log.finish_reason == "stop" and log.is_finished
    assert [t.finish_reason for t in log.sampled_tokens()] == [None, "stop"]
    full = RequestLog(record(max_tokens=2))
    full.fold(b"1-0", batch((0, 10), (1, 11)))
    assert full.is_finished


def test_an_end_cuts_the_tokens_no_client_saw() -> None:
    log = RequestLog(record())
    log.fold(b"1-0", batch((0, 10), (1, 11), (2, 12)))
    log.fold(b"2-0", RequestEnded(request_id="r", num_tokens=1))
    log.fold(b"3-0", batch((3, 13)))
    assert log.token_ids == [10] and log.ended_after == 1 and log.is_finished
    entries = log.as_entries()
    assert isinstance(entries[-1], RequestEnded) and entries[-1].num_tokens == 1
