"""Counters of a Redis hash (the ``stats`` hash), summed in the process and
sent a few times a second instead of a command per field per step.

``take_if_due`` hands over what was added since the last time (at most every
``interval_s``, or at once when forced: an idle actor sends what it has, so
a reader sees every step soon after the last one); ``queue`` puts it on a
transaction; ``give_back`` returns it when that transaction failed, so the
next one carries it and nothing is counted twice or lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from redis.asyncio.client import Pipeline

Increments = dict[str, int | float]


class HashCounters:
    """Increments to fields of one hash, not yet sent."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._pending: Increments = {}
        self._last_taken_s = clock()

    def add(self, field: str, value: int | float) -> None:
        """Add ``value`` to ``field`` (an int stays an int: HINCRBY, else HINCRBYFLOAT)."""
        self._pending[field] = self._pending.get(field, 0) + value

    def take_if_due(self, force: bool = False) -> Increments:
        """What to send now: everything pending once ``interval_s`` has passed
        since the last time (or when ``force``), else nothing."""
        now = self._clock()
        if not self._pending or (not force and now - self._last_taken_s < self._interval_s):
            return {}
        taken, self._pending = self._pending, {}
        self._last_taken_s = now
        return taken

    def give_back(self, taken: Increments) -> None:
        """``taken`` was not sent (its transaction failed): send it next time."""
        for field, value in taken.items():
            self.add(field, value)


def queue_increments(pipe: Pipeline, key: str, increments: Increments) -> None:
    """One HINCRBY (int) or HINCRBYFLOAT (float) per field on ``pipe``."""
    for field, value in increments.items():
        if isinstance(value, int):
            pipe.hincrby(key, field, value)
        else:
            pipe.hincrbyfloat(key, field, value)
