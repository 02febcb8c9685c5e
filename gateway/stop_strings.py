"""Stop strings over a stream of text deltas: pure, one matcher per request.

Text arrives in pieces (the incremental detokenizer's deltas), so a stop
string can straddle pieces. The matcher holds back the longest tail of what it
has seen that could still become the start of a stop string, and emits the
rest. When a stop string completes it emits the text up to (not including) it
and stops: the output is exactly the whole text cut before the stop string
occurrence that ends first, however the text was split. Text fed with
``can_stop=False`` (a request's tokens before its ``min_tokens``) goes out
whole: an occurrence ending in it does not count, one that only ends later does.

Each stop string has a Knuth-Morris-Pratt automaton that follows the longest
of its prefixes the text ends with, so a character costs amortized O(1) per
stop string: the work per token is linear in its text, whatever the output's
length, and the held-back tail is shorter than the longest stop string
(shared/protocol.py caps both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    """What one piece of text let through: ``text`` may be sent; ``stopped``
    says a stop string matched and nothing more may be sent for the request."""

    text: str
    stopped: bool = False


def truncate_at_stop(text: str, stop: Sequence[str], num_unstoppable: int = 0) -> str | None:
    """``text`` cut before the stop-string occurrence that ends first (the
    longer one when two end together), or None when no stop string occurs;
    occurrences that end within the first ``num_unstoppable`` characters do not count.

    The reference the streaming matcher agrees with; ending first is what
    "first" must mean for a stream, since a stop string is only known to have
    occurred once its last character has arrived.
    """
    best: tuple[int, int] | None = None  # (end, start) of the earliest-ending occurrence
    for stop_string in stop:
        # The first occurrence that ends past num_unstoppable starts at or after this.
        start = text.find(stop_string, max(0, num_unstoppable - len(stop_string) + 1))
        if start < 0:
            continue
        candidate = (start + len(stop_string), start)
        if best is None or candidate < best:
            best = candidate
    return None if best is None else text[: best[1]]


class _PrefixAutomaton:
    """How long a prefix of ``pattern`` the text fed so far ends with (KMP)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        # failure[i]: length of the longest proper prefix of pattern[: i + 1] that
        # is also its suffix, where matching falls back to after a mismatch.
        failure = [0] * len(pattern)
        length = 0
        for index in range(1, len(pattern)):
            while length and pattern[index] != pattern[length]:
                length = failure[length - 1]
            if pattern[index] == pattern[length]:
                length += 1
            failure[index] = length
        self._failure = failure
        self.state = 0

    def scan(self, text: str, start: int) -> int | None:
        """Feed ``text[start:]``; return the end of the first full match, or None.

        After a match, :meth:`resume_after_match` comes before the next scan.
        """
        pattern, failure = self.pattern, self._failure
        state, index = self.state, start
        while index < len(text):
            if state == 0:
                # Nothing partly matched: jump (in C) to the next possible start.
                index = text.find(pattern[0], index)
                if index < 0:
                    break
                state, index = 1, index + 1
            else:
                character = text[index]
                while state and pattern[state] != character:
                    state = failure[state - 1]
                if pattern[state] == character:
                    state += 1
                index += 1
            if state == len(pattern):
                self.state = state
                return index
        self.state = state
        return None

    def resume_after_match(self) -> None:
        """Go on after a full match as after a mismatch: the match's longest proper
        suffix that is also a prefix may start the next occurrence."""
        assert self.state == len(self.pattern), "resume without a match"
        self.state = self._failure[-1]

    def scan_past_matches(self, text: str, start: int) -> None:
        """Feed ``text[start:]``, going on after every match (none of them counts)."""
        while (end := self.scan(text, start)) is not None:
            self.resume_after_match()
            start = end


class StopStringMatcher:
    """Feed text deltas in order; get back what may be sent so far."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not stop_string for stop_string in stop):
            raise ValueError("stop strings must not be empty")
        self._automata = [_PrefixAutomaton(stop_string) for stop_string in stop]
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched."""
        return self._stopped

    def feed(self, delta: str, *, can_stop: bool = True) -> StopResult:
        """Add ``delta``; return the text now safe to send and whether a stop string
        matched. With ``can_stop`` False no occurrence ending in ``delta`` stops
        the stream (one may still start in it and end in a later delta)."""
        if self._stopped:
            raise RuntimeError("feed after a stop string matched")
        if not self._automata:
            return StopResult(delta)
        text = self._held + delta
        if can_stop:
            # The occurrence that ends first, the longer of two ending together.
            first: tuple[int, int] | None = None  # (end, -length)
            for automaton in self._automata:
                end = automaton.scan(text, len(self._held))
                if end is not None and (first is None or (end, -len(automaton.pattern)) < first):
                    first = (end, -len(automaton.pattern))
            if first is not None:
                self._held = ""
                self._stopped = True
                end, negative_length = first
                return StopResult(text[: end + negative_length], stopped=True)
        else:
            for automaton in self._automata:
                automaton.scan_past_matches(text, len(self._held))
        # Every state is below its pattern's length here, so the tail is a proper prefix.
        held_length = max(automaton.state for automaton in self._automata)
        self._held = text[len(text) - held_length :] if held_length else ""
        return StopResult(text[: len(text) - held_length])

    def flush(self) -> str:
        """At the end of the stream: the held-back text (it can no longer become a stop string)."""
        held, self._held = self._held, ""
        # The automata follow the held text: with it gone, nothing is partly matched.
        for automaton in self._automata:
            automaton.state = 0
        return held
