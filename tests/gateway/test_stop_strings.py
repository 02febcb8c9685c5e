"""The stop-string matcher: streamed output equals the whole text cut before the first stop."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.stop_strings import StopResult, StopStringMatcher, truncate_at_stop


def run_matcher(deltas: list[str], stop: list[str], num_unstoppable: int = 0) -> tuple[str, bool]:
    """Feed ``deltas`` until a stop, the first ``num_unstoppable`` of them with
    can_stop False (a request's tokens before min_tokens); flush at the end of
    the stream like the gateway does."""
    matcher = StopStringMatcher(stop)
    output = []
    for index, delta in enumerate(deltas):
        result = matcher.feed(delta, can_stop=index >= num_unstoppable)
        output.append(result.text)
        if result.stopped:
            return "".join(output), True
    output.append(matcher.flush())
    return "".join(output), False


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def test_holds_back_a_possible_start_then_releases_it() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("hello <").text == "hello "
    assert matcher.feed("/").text == ""
    assert matcher.feed("b").text == "</b"
    assert matcher.feed(" done").text == " done"


def test_match_across_deltas_stops_before_the_stop_string() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST").text == "abc "
    result = matcher.feed("OP and more")
    assert result.stopped and result.text == ""
    assert matcher.stopped
    with pytest.raises(RuntimeError):
        matcher.feed("x")


def test_flush_returns_held_text_at_the_end() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("a ##").text == "a "
    assert matcher.flush() == "##"


def test_no_stop_strings_passes_everything_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything ").text == "anything "
    assert matcher.flush() == ""


def test_the_stop_string_that_ends_first_wins() -> None:
    # "bc" is complete before "abcd" could be: a stream can only stop there.
    assert run_matcher(["a", "b", "c", "d"], ["abcd", "bc"]) == ("a", True)
    assert truncate_at_stop("xabcd", ["abcd", "bc"]) == "xa"
    assert truncate_at_stop("nothing", ["zz"]) is None


def test_before_min_tokens_a_stop_string_goes_out_as_text() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("one END two E", can_stop=False) == StopResult("one END two ")
    assert matcher.feed("ND three") == StopResult("", stopped=True)  # ends past min_tokens
    # Only an occurrence that ends where the request may stop counts.
    assert run_matcher(["xEND", "END"], ["END"], num_unstoppable=1) == ("xEND", True)
    assert run_matcher(["aa", "a"], ["aa"], num_unstoppable=1) == ("a", True)  # overlapping
    assert run_matcher(["ENDEND", "x"], ["END"], num_unstoppable=1) == ("ENDENDx", False)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""])


ALPHABET = "ab<>/ 🙂"


@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
)
def test_streamed_output_is_the_text_cut_before_the_first_stop(
    text: str, cuts: list[int], stop: list[str]
) -> None:
    output, stopped = run_matcher(split_at(text, cuts), stop)
    expected = truncate_at_stop(text, stop)
    assert stopped == (expected is not None)
    assert output == (text if expected is None else expected)


@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    stop=st.text(alphabet=ALPHABET, min_size=1, max_size=4),
)
def test_one_stop_string_cuts_at_its_first_occurrence(
    text: str, cuts: list[int], stop: str
) -> None:
    output, _ = run_matcher(split_at(text, cuts), [stop])
    position = text.find(stop)
    assert output == (text if position < 0 else text[:position])


@given(
    text=st.text(alphabet="ab", max_size=200),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=30),
    stop=st.lists(st.text(alphabet="ab", min_size=1, max_size=24), max_size=16),
)
def test_many_long_overlapping_stop_strings_agree_with_the_reference(
    text: str, cuts: list[int], stop: list[str]
) -> None:
    # A two-letter alphabet makes stop strings overlap themselves and each other,
    # which is where the automata's fallbacks matter.
    output, stopped = run_matcher(split_at(text, cuts), stop)
    expected = truncate_at_stop(text, stop)
    assert stopped == (expected is not None)
    assert output == (text if expected is None else expected)


@given(
    text=st.text(alphabet="ab", max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12),
    stop=st.lists(st.text(alphabet="ab", min_size=1, max_size=6), max_size=4),
    num_unstoppable=st.integers(min_value=0, max_value=14),
)
def test_stop_strings_ending_before_min_tokens_do_not_count(
    text: str, cuts: list[int], stop: list[str], num_unstoppable: int
) -> None:
    deltas = split_at(text, cuts)
    num_chars = len("".join(deltas[:num_unstoppable]))
    output, stopped = run_matcher(deltas, stop, num_unstoppable)
    expected = truncate_at_stop(text, stop, num_unstoppable=num_chars)
    assert stopped == (expected is not None)
    assert output == (text if expected is None else expected)


def test_held_back_text_stays_shorter_than_the_longest_stop_string() -> None:
    """The worst case for holding back: a stream that always ends in a prefix of
    every stop string. What is held (and rescanned) never grows with the output."""
    stop = ["a" * 255 + "b", "a" * 100 + "c", "a" * 255 + "d", "aab"]
    matcher = StopStringMatcher(stop)
    emitted = 0
    for index in range(5_000):
        result = matcher.feed("a")
        assert not result.stopped
        emitted += len(result.text)
        assert emitted == max(0, index + 1 - 255)
    assert matcher.flush() == "a" * 255
    assert matcher.feed("b").stopped is False  # flushed: the held a's are gone
