"""Folding a request's log: each index once, the first token kept, the end respected."""

from __future__ import annotations

from shared.messages import (
    RequestEnded,
    RequestFailed,
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


def test_an_end_logged_before_its_tokens_still_lets_them_in() -> None:
    """The gateway's RequestEnded (the client got 2) can precede the scheduler's
    checkpoint of those tokens: they still count, the third does not."""
    log = RequestLog(record())
    log.fold(b"1-0", RequestEnded(request_id="r", num_tokens=2))
    assert log.is_finished and log.wants_tokens
    log.fold(b"2-0", batch((0, 10), (1, 11), (2, 12)))
    assert log.token_ids == [10, 11] and log.ended_after == 2 and not log.wants_tokens


def test_tokens_before_a_failure_count_in_any_order_of_sources() -> None:
    log = RequestLog(record())
    log.fold(b"1-0", RequestFailed(request_id="r", code="internal", message="boom"))
    log.fold_tokens(batch((0, 10), (1, 11)).tokens)  # found later, in the journal
    assert log.token_ids == [10, 11] and log.failure is not None and log.is_finished


def test_a_checkpoint_and_the_journal_overlap_without_doubling() -> None:
    log = RequestLog(record(max_tokens=4))
    log.fold(b"1-0", batch((0, 10), (1, 11)))  # the checkpoint
    log.fold_tokens(batch((1, 11), (2, 12), (3, 13, "length")).tokens)  # the journal
    assert log.token_ids == [10, 11, 12, 13] and log.finish_reason == "length"
    assert not log.wants_tokens
