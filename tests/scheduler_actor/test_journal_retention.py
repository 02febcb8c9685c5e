"""Which journal entries stay: the oldest token of each request not yet in its log."""

from __future__ import annotations

from scheduler_actor.journal_retention import JournalRetention, parse_entry_id


def test_the_trim_point_is_the_oldest_unlogged_token() -> None:
    retention = JournalRetention()
    assert retention.trim_point() is None
    retention.on_entry(b"100-0", ["a", "b"])
    retention.on_entry(b"100-1", ["a", "b", "c"])
    assert retention.trim_point() == "100-0"
    retention.logged("a", 2)
    assert retention.trim_point() == "100-0"  # b still holds it
    retention.logged("b", 2)
    assert retention.trim_point() == "100-1"  # c's first token
    assert retention.num_logged("a") == 2 and retention.num_logged("c") == 0
    retention.forget("c")
    # Nothing unlogged: every entry read so far can go.
    assert retention.trim_point() == "100-2"


def test_requests_holding_the_journal_longest_are_due_by_redis_time() -> None:
    retention = JournalRetention()
    retention.on_entry(b"1000-0", ["old"])
    retention.on_entry(b"9000-0", ["new"])
    retention.on_entry(b"12000-5", ["old", "new"])  # "now", in Redis's clock
    assert retention.due(max_age_ms=10_000) == ["old"]
    assert retention.due(max_age_ms=2_000) == ["old", "new"]
    retention.logged("old", 3)
    assert retention.due(max_age_ms=2_000) == ["new"]
    # After a checkpoint, its next token pins the entry it is in.
    retention.on_entry(b"12001-0", ["old"])
    assert retention.trim_point() == "9000-0"


def test_entry_ids_order_like_redis() -> None:
    assert parse_entry_id(b"10-2") < parse_entry_id("10-10") < parse_entry_id(b"11-0")
