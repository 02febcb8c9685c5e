"""A worker's Prometheus metrics (``docs/metrics.md``), labelled ``worker``.

The totals are the engine's own counters (``Engine.stats``), read when
Prometheus scrapes; the histograms and the busy window take each step's
``StepOutput`` once, from the publisher on the event loop, never from the
engine thread between two forward passes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_worker.engine_stats import EngineStats
from shared.messages import StepOutput
from shared.metrics_labels import labelled_registry

# 0.5 ms (a small decode on a GPU) to 10 s (a long prefill on a CPU).
STEP_TIME_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Requests per step: up to the scheduler's largest batch sizes.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# New tokens per step: one per decode, up to a whole token budget of prompt chunks.
TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BUSY_WINDOW_S = 5.0


class BusyWindow:
    """The share of the last ``window_s`` seconds spent in forward passes.

    Pure: times come from the caller. A step counts whole in the window it
    ended in, so a long step that began before it may lift the share above
    the truth for a moment; the share is capped at 1.
    """

    __slots__ = ("_busy_s", "_started_s", "_steps", "window_s")

    def __init__(self, window_s: float, started_s: float) -> None:
        assert window_s > 0
        self.window_s = window_s
        self._started_s = started_s
        self._steps: collections.deque[tuple[float, float]] = collections.deque()
        self._busy_s = 0.0

    def add(self, end_s: float, busy_s: float) -> None:
        """A forward pass of ``busy_s`` seconds that ended at ``end_s``."""
        self._steps.append((end_s, busy_s))
        self._busy_s += busy_s
        self._forget_before(end_s - self.window_s)

    def fraction(self, now_s: float) -> float:
        """Busy share of the window ending at ``now_s`` (of the time since the
        start, while that is shorter), 0..1."""
        self._forget_before(now_s - self.window_s)
        elapsed_s = min(self.window_s, now_s - self._started_s)
        if elapsed_s <= 0:
            return 0.0
        return min(1.0, self._busy_s / elapsed_s)

    def _forget_before(self, cutoff_s: float) -> None:
        steps = self._steps
        while steps and steps[0][0] <= cutoff_s:
            self._busy_s -= steps.popleft()[1]
        if not steps:
            self._busy_s = 0.0  # no rounding drift survives an idle window


class WorkerMetrics:
    """One worker's registry: per-step histograms and the engine's totals;
    ``model_name`` on every series."""

    def __init__(
        self,
        worker_id: str,
        stats: EngineStats,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = BUSY_WINDOW_S,
        model_name: str = "",
    ) -> None:
        own = CollectorRegistry()
        self.registry = labelled_registry(own, {"model_name": model_name})
        self._clock = clock
        self._busy = BusyWindow(window_s, clock())
        self._worker_id = worker_id
        self._step_time_s = Histogram(
            "orcapod_step_time_seconds",
            "Time of one forward pass (one plan) on the worker, by the path it took "
            "(gpu_worker/step_path.py: eager, eager+paged_attention, graph[1], ...).",
            ["worker", "path"],
            buckets=STEP_TIME_BUCKETS_S,
            registry=own,
        )
        self._batch_size = Histogram(
            "orcapod_batch_size",
            "Requests in one step (prompt chunks and decodes).",
            ["worker"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=own,
        ).labels(worker_id)
        self._tokens_per_step = Histogram(
            "orcapod_tokens_per_step",
            "New tokens (prompt and decode) in one step.",
            ["worker"],
            buckets=TOKENS_PER_STEP_BUCKETS,
            registry=own,
        ).labels(worker_id)
        own.register(_EngineView(worker_id, stats, self._busy, clock))

    def observe_step(self, output: StepOutput, num_requests: int) -> None:
        """One executed plan; one that ran no forward pass (a release only, a
        refused plan) is no step."""
        if not output.num_new_tokens:
            return
        step_s = output.step_ms / 1000
        self._step_time_s.labels(self._worker_id, output.path).observe(step_s)
        self._batch_size.observe(num_requests)
        self._tokens_per_step.observe(output.num_new_tokens)
        self._busy.add(self._clock(), step_s)


class _EngineView(Collector):
    """The engine's counters and the busy share, read at each scrape."""

    def __init__(
        self, worker_id: str, stats: EngineStats, busy: BusyWindow, clock: Callable[[], float]
    ) -> None:
        self._worker_id = worker_id
        self._stats = stats
        self._busy = busy
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        # The engine thread writes these; reading an int or a float is atomic.
        labels = [self._worker_id]
        steps = CounterMetricFamily(
            "orcapod_steps", "Forward passes the engine ran.", labels=["worker"]
        )
        steps.add_metric(labels, self._stats.num_steps)
        busy_s = CounterMetricFamily(
            "orcapod_busy_seconds", "Seconds spent in forward passes.", labels=["worker"]
        )
        busy_s.add_metric(labels, self._stats.busy_s)
        fraction = GaugeMetricFamily(
            "orcapod_busy_fraction",
            f"Share of the last {self._busy.window_s:g} s spent in forward passes (0..1).",
            labels=["worker"],
        )
        fraction.add_metric(labels, self._busy.fraction(self._clock()))
        live = GaugeMetricFamily(
            "orcapod_step_path_live",
            "1 for each step path the engine serves on now (gpu_worker/step_path.py); "
            "compiled ones join as they pass their start-up checks.",
            labels=["worker", "path"],
        )
        for path in list(self._stats.live_paths):
            live.add_metric([self._worker_id, path], 1)
        compiling = GaugeMetricFamily(
            "orcapod_step_paths_compiling",
            "1 while the engine builds compiled step paths, serving on the others meanwhile.",
            labels=["worker"],
        )
        compiling.add_metric(labels, int(self._stats.compiling_paths))
        yield from (steps, busy_s, fraction, live, compiling)
