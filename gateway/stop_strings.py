"""Stop strings over a stream of text deltas: pure, one matcher per request.

Text arrives in pieces (the incremental detokenizer's deltas), so a stop
string can straddle pieces. The matcher holds back the longest tail of what it
has seen that could still become the start of a stop string, and emits the
rest. When a stop string completes it emits the text up to (not including) it
and stops: the output is exactly the whole text cut before the stop string
occurrence that ends first, however the text was split.
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


def truncate_at_stop(text: str, stop: Sequence[str]) -> str | None:
    """``text`` cut before the stop-string occurrence that ends first (the
    longer one when two end together), or None when no stop string occurs.

    The reference the streaming matcher agrees with; ending first is what
    "first" must mean for a stream, since a stop string is only known to have
    occurred once its last character has arrived.
    """
    best: tuple[int, int] | None = None  # (end, start) of the earliest-ending occurrence
    for stop_string in stop:
        start = text.find(stop_string)
        if start < 0:
            continue
        candidate = (start + len(stop_string), start)
        if best is None or candidate < best:
            best = candidate
    return None if best is None else text[: best[1]]


class StopStringMatcher:
    """Feed text deltas in order; get back what may be sent so far."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not stop_string for stop_string in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(stop)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched."""
        return self._stopped

    def feed(self, delta: str) -> StopResult:
        """Add ``delta``; return the text now safe to send and whether a stop string matched."""
        if self._stopped:
            raise RuntimeError("feed after a stop string matched")
        if not self._stop:
            return StopResult(delta)
        text = self._held + delta
        truncated = truncate_at_stop(text, self._stop)
        if truncated is not None:
            self._held = ""
            self._stopped = True
            return StopResult(truncated, stopped=True)
        held_length = self._longest_partial_match(text)
        self._held = text[len(text) - held_length :] if held_length else ""
        return StopResult(text[: len(text) - held_length])

    def flush(self) -> str:
        """At the end of the stream: the held-back text (it can no longer become a stop string)."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_match(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop_string in self._stop:
            # Only tails shorter than the stop string: a whole one was found above.
            for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
                if text.endswith(stop_string[:length]):
                    longest = length
                    break
        return longest
