"""The connection guard's pure core: admission by caps, one connection's
phases and deadlines, the byte bound, and the rate of log lines; and the
flags that set its limits."""

from __future__ import annotations

import pytest

from gateway.__main__ import parse_settings
from gateway.connection_guard import (
    CloseReason,
    ConnectionClock,
    ConnectionCounts,
    ConnectionLimits,
    EventTally,
    Phase,
    address_key,
)

LIMITS = ConnectionLimits(
    idle_timeout_s=15.0,
    header_timeout_s=10.0,
    body_timeout_s=30.0,
    max_connections=4,
    max_connections_per_address=2,
    max_body_bytes=1000,
    overhead_bytes=100,
)


def test_counts_refuse_past_the_cap_per_address_then_in_all() -> None:
    counts = ConnectionCounts(LIMITS)
    for address in ("10.0.0.1", "10.0.0.1", "10.0.0.2"):
        assert counts.refusal(address) is None
        counts.admit(address)
    assert counts.refusal("10.0.0.1") is CloseReason.MAX_CONNECTIONS_PER_ADDRESS
    assert counts.refusal("10.0.0.2") is None
    counts.admit("10.0.0.2")
    # Four open: everyone is refused, whatever their own count.
    assert counts.refusal("10.0.0.3") is CloseReason.MAX_CONNECTIONS
    assert counts.num_connections == 4


def test_a_released_connection_makes_room_and_leaves_nothing_behind() -> None:
    counts = ConnectionCounts(LIMITS)
    counts.admit("10.0.0.1")
    counts.admit("10.0.0.1")
    counts.release("10.0.0.1")
    assert counts.refusal("10.0.0.1") is None
    counts.release("10.0.0.1")
    assert counts.num_connections == 0 and counts.num_from("10.0.0.1") == 0
    assert not counts._by_address  # no entry kept per address ever seen


def test_admitting_over_a_cap_or_releasing_nothing_is_a_bug() -> None:
    counts = ConnectionCounts(LIMITS)
    with pytest.raises(AssertionError):
        counts.release("10.0.0.1")
    counts.admit("10.0.0.1")
    counts.admit("10.0.0.1")
    with pytest.raises(AssertionError):
        counts.admit("10.0.0.1")


def test_a_cap_of_zero_is_no_cap() -> None:
    counts = ConnectionCounts(
        ConnectionLimits(
            idle_timeout_s=1.0,
            header_timeout_s=1.0,
            body_timeout_s=1.0,
            max_connections=0,
            max_connections_per_address=0,
            max_body_bytes=0,
        )
    )
    for _ in range(10_000):
        counts.admit("10.0.0.1")
    assert counts.refusal("10.0.0.1") is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("idle_timeout_s", 0.0),
        ("header_timeout_s", -1.0),
        ("body_timeout_s", float("nan")),
        ("max_connections", -1),
        ("max_connections_per_address", -5),
    ],
)
def test_limits_refuse_values_that_mean_nothing(field: str, value: float) -> None:
    fields = {
        "idle_timeout_s": 1.0,
        "header_timeout_s": 1.0,
        "body_timeout_s": 1.0,
        "max_connections": 1,
        "max_connections_per_address": 1,
        "max_body_bytes": 1,
        field: value,
    }
    with pytest.raises(ValueError, match=field):
        ConnectionLimits(**fields)  # type: ignore[arg-type]


def test_address_key_counts_an_ipv6_client_by_its_64() -> None:
    assert address_key("192.0.2.7") == "192.0.2.7"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:ffff::9")
    assert address_key("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert address_key("") == ""


def test_an_idle_connection_times_out_after_the_idle_timeout() -> None:
    clock = ConnectionClock(LIMITS, now_s=100.0)
    assert clock.phase is Phase.IDLE and clock.deadline_s() == 115.0
    assert clock.expired(114.9) is None
    assert clock.expired(115.0) is CloseReason.IDLE_TIMEOUT


def test_headers_get_their_own_timeout_from_the_first_byte() -> None:
    clock = ConnectionClock(LIMITS, now_s=100.0)
    clock.receive(1, now_s=112.0)
    assert clock.phase is Phase.HEADERS and clock.deadline_s() == 122.0
    # More header lines do not move the deadline (a slowloris gains nothing).
    clock.receive(20, now_s=121.0)
    assert clock.deadline_s() == 122.0
    assert clock.expired(122.0) is CloseReason.HEADER_TIMEOUT


def test_the_body_gets_its_timeout_once_the_headers_are_in() -> None:
    clock = ConnectionClock(LIMITS, now_s=0.0)
    clock.receive(200, now_s=1.0)
    clock.start_request(body_complete=False, now_s=2.0)
    assert clock.phase is Phase.BODY and clock.deadline_s() == 32.0
    clock.receive(3, now_s=31.0)  # a drip does not move it either
    assert clock.expired(32.0) is CloseReason.BODY_TIMEOUT
    clock.end_body()
    # The answer may take as long as it takes (a stream may run for minutes).
    assert clock.phase is Phase.HANDLING and clock.deadline_s() is None
    assert clock.expired(1e9) is None


def test_between_keep_alive_requests_the_idle_timeout_runs_again() -> None:
    clock = ConnectionClock(LIMITS, now_s=0.0)
    clock.receive(100, now_s=1.0)
    clock.start_request(body_complete=True, now_s=1.0)
    assert clock.phase is Phase.HANDLING
    clock.end_request(now_s=50.0)
    assert clock.phase is Phase.IDLE and clock.deadline_s() == 65.0
    clock.receive(10, now_s=60.0)
    assert clock.phase is Phase.HEADERS and clock.deadline_s() == 70.0


def test_a_pipelined_request_starts_no_clock_while_an_answer_runs() -> None:
    clock = ConnectionClock(LIMITS, now_s=0.0)
    clock.start_request(body_complete=True, now_s=0.0)
    clock.receive(10, now_s=5.0)  # the next request's first bytes
    assert clock.phase is Phase.HANDLING and clock.deadline_s() is None
    clock.end_request(now_s=100.0)
    assert clock.deadline_s() == 115.0


def test_the_byte_bound_counts_one_request_from_its_first_byte_to_its_body_end() -> None:
    clock = ConnectionClock(LIMITS, now_s=0.0)
    assert LIMITS.max_request_bytes == 1100
    clock.receive(100, now_s=0.0)
    clock.start_request(body_complete=False, now_s=0.0)
    clock.receive(1000, now_s=0.0)
    assert not clock.can_receive(1)
    with pytest.raises(AssertionError):
        clock.receive(1, now_s=0.0)
    clock.end_body()
    # The next request starts from nothing.
    assert clock.request_bytes == 0 and clock.can_receive(1100)
    clock.end_request(now_s=1.0)
    clock.receive(600, now_s=2.0)
    clock.start_request(body_complete=True, now_s=2.0)
    assert clock.request_bytes == 0


def test_a_websocket_has_no_deadline_and_no_byte_bound() -> None:
    clock = ConnectionClock(LIMITS, now_s=0.0)
    clock.start_request(body_complete=True, now_s=0.0)
    clock.upgrade()
    assert clock.phase is Phase.UPGRADED
    assert clock.can_receive(10 * LIMITS.max_request_bytes)
    clock.receive(10 * LIMITS.max_request_bytes, now_s=1.0)
    clock.end_request(now_s=1000.0)  # the socket's handler returned
    assert clock.deadline_s() is None and clock.expired(1e9) is None


def test_the_tally_logs_the_first_event_then_one_line_per_interval() -> None:
    tally = EventTally(interval_s=10.0)
    refused = CloseReason.MAX_CONNECTIONS_PER_ADDRESS
    assert tally.note(refused, now_s=0.0) == 1
    assert [tally.note(refused, now_s=0.1 * i) for i in range(1, 50)] == [0] * 49
    # Another reason has its own line.
    assert tally.note(CloseReason.HEADER_TIMEOUT, now_s=5.0) == 1
    assert tally.note(refused, now_s=10.0) == 50  # the 49 held and this one
    assert tally.note(refused, now_s=10.5) == 0
    assert tally.note(refused, now_s=30.0) == 2


def test_the_flags_set_the_limits_and_refuse_values_that_mean_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = parse_settings([])
    assert (defaults.idle_timeout_s, defaults.header_timeout_s, defaults.body_timeout_s) == (
        15.0,
        10.0,
        30.0,
    )
    assert (defaults.max_connections, defaults.max_connections_per_address) == (8192, 1024)
    settings = parse_settings(
        [
            "--idle-timeout-s=2",
            "--header-timeout-s=0.5",
            "--body-timeout-s=60",
            "--max-connections=0",
            "--max-connections-per-address=16",
        ]
    )
    assert (settings.idle_timeout_s, settings.header_timeout_s, settings.body_timeout_s) == (
        2.0,
        0.5,
        60.0,
    )
    assert (settings.max_connections, settings.max_connections_per_address) == (0, 16)
    monkeypatch.setenv("ORCAPOD_MAX_CONNECTIONS_PER_ADDRESS", "0")
    assert parse_settings([]).max_connections_per_address == 0
    for bad in ("--idle-timeout-s=0", "--body-timeout-s=-1", "--header-timeout-s=inf"):
        with pytest.raises(SystemExit):
            parse_settings([bad])
        assert "must be a number above 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--max-connections=-1"])
    assert "must be >= 0, got -1" in capsys.readouterr().err
    # A bad value from the environment is the same usage error, not a traceback.
    monkeypatch.setenv("ORCAPOD_BODY_TIMEOUT_S", "-3")
    with pytest.raises(SystemExit):
        parse_settings([])
    assert "--body-timeout-s: must be a number above 0, got -3" in capsys.readouterr().err
