"""Stats counters summed in the process: sent at most every interval, at once
when forced, and given back (never lost, never doubled) when a send failed."""

from __future__ import annotations

from shared.hash_counters import HashCounters


def test_counters_are_summed_and_sent_at_most_every_interval() -> None:
    now = [0.0]
    counters = HashCounters(0.25, clock=lambda: now[0])
    counters.add("w:num_steps", 1)
    counters.add("w:num_steps", 1)
    counters.add("w:busy_s", 0.5)
    assert counters.take_if_due() == {}  # not yet due
    now[0] = 0.3
    taken = counters.take_if_due()
    assert taken == {"w:num_steps": 2, "w:busy_s": 0.5}
    assert isinstance(taken["w:num_steps"], int)
    assert counters.take_if_due(force=True) == {}  # nothing pending


def test_forced_sends_now_and_a_failed_send_is_given_back() -> None:
    now = [0.0]
    counters = HashCounters(10.0, clock=lambda: now[0])
    counters.add("w:num_tokens", 32)
    taken = counters.take_if_due(force=True)
    assert taken == {"w:num_tokens": 32}
    counters.add("w:num_tokens", 8)
    counters.give_back(taken)  # its transaction failed
    assert counters.take_if_due(force=True) == {"w:num_tokens": 40}
