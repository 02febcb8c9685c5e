"""Wall-clock timing of the benchmarks: calls after an untimed warm-up, their median,
and runs taking turns (this machine's speed drifts by tens of per cent within minutes;
taking turns gives each side the same; docs/performance.md, *How to measure*)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TypeVar

Key = TypeVar("Key")
Result = TypeVar("Result")


def timed_s(run: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    """Seconds of one call of ``run``, after an untimed call of ``before``."""
    if before is not None:
        before()
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def times_s(
    run: Callable[[], object],
    num_calls: int,
    before: Callable[[], object] | None = None,
    warmups: int = 1,
) -> list[float]:
    """Seconds of each of ``num_calls`` calls of ``run`` after ``warmups`` untimed ones,
    each call after ``before``."""
    times = [timed_s(run, before) for _ in range(warmups + num_calls)]
    return times[warmups:]


def median_s(
    run: Callable[[], object],
    num_calls: int,
    before: Callable[[], object] | None = None,
    warmups: int = 1,
) -> float:
    """Median seconds of ``times_s``."""
    return statistics.median(times_s(run, num_calls, before, warmups))


def in_turns(runs: Mapping[Key, Callable[[], Result]], num_rounds: int) -> dict[Key, list[Result]]:
    """Each run called once a round, in order, for ``num_rounds`` rounds; their results."""
    results: dict[Key, list[Result]] = {key: [] for key in runs}
    for _ in range(num_rounds):
        for key, run in runs.items():
            results[key].append(run())
    return results


def interleaved_median_s(
    runs: Sequence[tuple[Callable[[], object], Callable[[], object]]], num_calls: int
) -> list[float]:
    """Median seconds of each ``(run, before)`` over ``num_calls`` calls after one untimed
    warm-up round, the runs taking turns call by call."""
    calls = {index: partial(timed_s, run, before) for index, (run, before) in enumerate(runs)}
    rounds = in_turns(calls, 1 + num_calls)
    return [statistics.median(rounds[index][1:]) for index in range(len(runs))]
