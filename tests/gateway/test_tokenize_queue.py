"""The tokenizer's fair queue, pure: tenants are served by characters started
(not by arrival), a tenant over its share is refused alone, the whole queue
is bounded in jobs and characters, and what waits or runs is counted exactly."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.tokenize_queue import (
    BUSY_MESSAGE,
    JOB_OVERHEAD_CHARS,
    TokenizeQueue,
    TokenizeQueueLimits,
    TokenizerQueueFull,
)

BIG = 100_000
SMALL = 20


def drain(queue: TokenizeQueue[str]) -> list[str]:
    """Every job in the order the queue starts them (each forgotten at once)."""
    order = []
    while (queued := queue.pop()) is not None:
        order.append(queued.job)
        queue.forget(queued.job)
    return order


def test_a_small_job_behind_a_flood_starts_next() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(TokenizeQueueLimits(max_chars_per_tenant=10 * BIG))
    for index in range(6):
        queue.push(f"bob{index}", "bob", BIG)
    # Two threads took bob's first two.
    assert [queue.pop().job for _ in range(2)] == ["bob0", "bob1"]  # type: ignore[union-attr]
    queue.push("carol0", "carol", SMALL)
    assert drain(queue) == ["carol0", "bob2", "bob3", "bob4", "bob5"]


def test_tenants_share_by_characters_not_by_jobs() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(TokenizeQueueLimits(max_chars_per_tenant=10 * BIG))
    for index in range(4):
        queue.push(f"bob{index}", "bob", 10_000)
    for index in range(40):
        queue.push(f"carol{index}", "carol", 1_000)
    order = drain(queue)
    # bob's first job costs what ten of carol's do (and their overheads).
    bob_positions = [order.index(f"bob{index}") for index in range(4)]
    gaps = [b - a - 1 for a, b in itertools.pairwise(bob_positions)]
    per_bob_job = (10_000 + JOB_OVERHEAD_CHARS) / (1_000 + JOB_OVERHEAD_CHARS)
    assert all(abs(gap - per_bob_job) <= 1 for gap in gaps), (order, gaps)


def test_a_heavier_tenant_gets_more() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(TokenizeQueueLimits())
    for index in range(20):
        queue.push(f"a{index}", "a", 1_000, weight=2.0)
        queue.push(f"b{index}", "b", 1_000, weight=1.0)
    first_twelve = drain(queue)[:12]
    assert sum(job.startswith("a") for job in first_twelve) == 8


def test_an_idle_tenant_banks_no_credit() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(TokenizeQueueLimits(max_chars_per_tenant=10 * BIG))
    for index in range(5):
        queue.push(f"a{index}", "a", 1_000)
    assert drain(queue) == [f"a{index}" for index in range(5)]
    # b was idle all along: it does not now get five jobs in a row.
    for index in range(3):
        queue.push(f"a{index + 5}", "a", 1_000)
        queue.push(f"b{index}", "b", 1_000)
    order = drain(queue)
    assert sorted(order[:2]) == ["a5", "b0"] and sorted(order[2:4]) == ["a6", "b1"]


def test_a_tenant_over_its_share_is_refused_and_only_it() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(
        TokenizeQueueLimits(max_chars_per_tenant=3 * BIG, max_chars=100 * BIG)
    )
    for index in range(3):
        queue.push(f"bob{index}", "bob", BIG)
    with pytest.raises(TokenizerQueueFull) as refused:
        queue.push("bob3", "bob", BIG)
    assert "tenant 'bob''s tokenizer queue is full" in refused.value.message
    assert queue.num_jobs == 3 and queue.chars_of("bob") == 3 * BIG
    queue.push("carol0", "carol", BIG)
    # Started jobs still count against the share until they end.
    bob0 = queue.pop()
    assert bob0 is not None and bob0.job == "bob0"
    with pytest.raises(TokenizerQueueFull):
        queue.push("bob3", "bob", BIG)
    queue.forget("bob0")
    queue.push("bob3", "bob", BIG)


def test_a_job_alone_is_taken_whatever_its_size() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(
        TokenizeQueueLimits(max_chars_per_tenant=10, max_chars=10)
    )
    queue.push("huge", "bob", BIG)
    with pytest.raises(TokenizerQueueFull) as refused:
        queue.push("other", "carol", SMALL)
    assert refused.value.message == BUSY_MESSAGE


def test_the_whole_queue_is_bounded_in_jobs_and_characters() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(
        TokenizeQueueLimits(max_jobs=3, max_chars=1_000, max_chars_per_tenant=1_000)
    )
    for tenant in ("a", "b", "c"):
        queue.push(tenant, tenant, 10)
    with pytest.raises(TokenizerQueueFull) as refused:
        queue.push("d", "d", 10)
    assert refused.value.message == BUSY_MESSAGE
    queue.forget("a")
    queue.push("d", "d", 10)
    with pytest.raises(TokenizerQueueFull) as refused:
        queue.push("e", "e", 971)  # 30 + 971 > 1,000
    assert refused.value.message == BUSY_MESSAGE


def test_a_size_limit_passes_over_long_jobs_without_charging_them() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(TokenizeQueueLimits(max_chars_per_tenant=10 * BIG))
    queue.push("bob0", "bob", BIG)
    queue.push("carol0", "carol", SMALL)
    queue.push("carol1", "carol", SMALL)
    taken = queue.pop(max_num_chars=1_000)
    assert taken is not None and taken.job == "carol0"
    assert queue.counter("bob") == 0
    # Without the limit bob, owed its turn, comes first.
    taken = queue.pop()
    assert taken is not None and taken.job == "bob0"
    assert queue.pop(max_num_chars=1_000) is not None
    assert queue.pop(max_num_chars=1_000) is None


def test_a_waiting_job_forgotten_leaves_no_trace() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(TokenizeQueueLimits())
    queue.push("a0", "a", 100)
    queue.push("a1", "a", 50)
    queue.forget("a0")
    queue.forget("a0")  # twice: nothing
    queue.forget("never")
    assert (queue.num_jobs, queue.num_waiting, queue.num_chars) == (1, 1, 50)
    assert drain(queue) == ["a1"]
    assert (queue.num_jobs, queue.num_chars, queue.chars_of("a")) == (0, 0, 0)


def test_jobs_without_characters_are_forgotten_in_any_order() -> None:
    # Requests of token ids hold no characters: two of one tenant, the first
    # forgotten first, once raised KeyError on the second (the pool's release
    # then never started the next job, and the gateway refused with queue_full).
    queue: TokenizeQueue[str] = TokenizeQueue(TokenizeQueueLimits())
    for job in ("a0", "a1", "a2"):
        queue.push(job, "a", 0)
    queue.pop()
    queue.forget("a0")
    queue.forget("a1")
    queue.push("a3", "a", 10)
    queue.forget("a2")
    assert (queue.num_jobs, queue.num_chars, queue.chars_of("a")) == (1, 10, 10)
    queue.forget("a3")
    assert (queue.num_jobs, queue.num_chars, queue.chars_of("a")) == (0, 0, 0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "pop", "forget"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(min_value=0, max_value=300),
        ),
        max_size=60,
    )
)
def test_what_waits_or_runs_is_counted_exactly(
    operations: list[tuple[str, str, int]],
) -> None:
    queue: TokenizeQueue[int] = TokenizeQueue(
        TokenizeQueueLimits(max_jobs=8, max_chars=1_000, max_chars_per_tenant=400)
    )
    live: dict[int, tuple[str, int]] = {}
    started: set[int] = set()
    for number, (operation, tenant, size) in enumerate(operations):
        if operation == "push":
            try:
                queue.push(number, tenant, size)
            except TokenizerQueueFull:
                continue
            live[number] = (tenant, size)
        elif operation == "pop":
            queued = queue.pop(max_num_chars=size)
            if queued is not None:
                assert queued.job in live and queued.job not in started
                assert queued.num_chars <= size
                started.add(queued.job)
        elif live:
            job = sorted(live)[size % len(live)]
            queue.forget(job)
            del live[job]
            started.discard(job)
        assert queue.num_jobs == len(live)
        assert queue.num_waiting == len(live) - len(started)
        assert queue.num_chars == sum(size for _, size in live.values())
        for name in ("a", "b", "c"):
            assert queue.chars_of(name) == sum(s for t, s in live.values() if t == name)
