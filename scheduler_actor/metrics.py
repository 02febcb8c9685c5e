"""The scheduler's Prometheus metrics (``docs/metrics.md``), shaped like vLLM's.

The gauges are a view of the core, read when Prometheus scrapes: nothing is
copied on the hot loop, so no second copy can drift, and a tenant or worker
the core no longer knows is simply not reported. Only what the core does not
keep as a total is counted as it happens: the plans sent to each worker and
the preemptions they carry (``plans_sent``, once per turn).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler_actor.core import Scheduler
from shared.messages import StepPlan


class SchedulerMetrics:
    """One scheduler's registry: its core's state, and counters of its plans."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._core_view = _CoreView()
        self.registry.register(self._core_view)
        self._num_plans = Counter(
            "orcapod_plans",
            "Step plans sent to a worker (rate(): plans per second).",
            ["worker"],
            registry=self.registry,
        )
        self._num_preemptions = Counter(
            "orcapod_num_preemptions",
            "Requests taken off a worker to be recomputed later (K/V ran out).",
            registry=self.registry,
        )

    def watch(self, core: Scheduler) -> None:
        """Report ``core`` from now on (each incarnation builds a new one)."""
        self._core_view.core = core

    def plans_sent(self, plans: Sequence[StepPlan], core: Scheduler) -> None:
        """Count plans that reached Redis and the preemptions in them.

        A plan's ``released_request_ids`` are cancels and preemptions; a
        cancelled request has already left the core, a preempted one waits
        again in it (or was placed again in the same plan): the live ones are
        this plan's preemptions. (A preemption in a step that then planned
        nothing travels with the worker's next plan; should its request be
        cancelled meanwhile, it goes uncounted.)
        """
        live = core.requests
        for plan in plans:
            self._num_plans.labels(plan.worker_id).inc()
            num_preempted = sum(1 for request_id in plan.released_request_ids if request_id in live)
            if num_preempted:
                self._num_preemptions.inc(num_preempted)


class _CoreView(Collector):
    """Gauges read from the watched core at each scrape."""

    def __init__(self) -> None:
        self.core: Scheduler | None = None

    def describe(self) -> Iterator[Metric]:
        # Describing without collecting keeps registration independent of a core.
        yield from _gauges()
        yield from _prefix_cache_counters()

    def collect(self) -> Iterator[Metric]:
        gauges = _gauges()
        waiting, running, blocks_used, blocks_total, usage, vtc_service, blocks_cached = gauges
        counters = _prefix_cache_counters()
        core = self.core
        if core is not None:
            # The tenants with a request waiting or running, and their counts,
            # as the tenant ledger (which admission uses) keeps them.
            tenants = core.tenants
            for tenant in tenants.active():
                waiting.add_metric([tenant], tenants.num_waiting(tenant))
                running.add_metric([tenant], tenants.num_running(tenant))
            for worker_id, worker in core.workers.items():
                blocks = worker.ledger
                blocks_used.add_metric([worker_id], blocks.num_used)
                blocks_total.add_metric([worker_id], blocks.num_blocks)
                usage.add_metric([worker_id], blocks.num_used / blocks.num_blocks)
                blocks_cached.add_metric([worker_id], blocks.num_cached)
            for tenant, counter in core.vtc.counters.items():
                vtc_service.add_metric([tenant], counter)
            stats = core.prefix_cache_stats
            values = (
                stats.num_queries,
                stats.num_hits,
                stats.num_query_tokens,
                stats.num_hit_tokens,
                stats.num_evictions,
            )
            for family, value in zip(counters, values, strict=True):
                family.add_metric([], value)
        yield from gauges
        yield from counters


def _prefix_cache_counters() -> tuple[CounterMetricFamily, ...]:
    return (
        CounterMetricFamily(
            "orcapod_prefix_cache_queries",
            "Placements that looked up a cached prompt prefix (all workers).",
        ),
        CounterMetricFamily(
            "orcapod_prefix_cache_hits",
            "Placements that found at least one cached block of their prompt.",
        ),
        CounterMetricFamily(
            "orcapod_prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache.",
        ),
        CounterMetricFamily(
            "orcapod_prefix_cache_hit_tokens",
            "Prompt tokens whose K/V came from the prefix cache (not computed).",
        ),
        CounterMetricFamily(
            "orcapod_prefix_cache_evictions",
            "Cached K/V blocks evicted to make room for new ones.",
        ),
    )


def _gauges() -> tuple[GaugeMetricFamily, ...]:
    return (
        GaugeMetricFamily(
            "orcapod_num_requests_waiting",
            "Requests of a tenant on no worker (queued, or preempted).",
            labels=["tenant"],
        ),
        GaugeMetricFamily(
            "orcapod_num_requests_running",
            "Requests of a tenant placed on a worker.",
            labels=["tenant"],
        ),
        GaugeMetricFamily(
            "orcapod_kv_blocks_used",
            "K/V blocks of a worker the scheduler has handed out.",
            labels=["worker"],
        ),
        GaugeMetricFamily(
            "orcapod_kv_blocks_total",
            "K/V blocks in a worker's pool.",
            labels=["worker"],
        ),
        GaugeMetricFamily(
            "orcapod_kv_cache_usage_perc",
            "Share of a worker's K/V blocks in use (1 = full).",
            labels=["worker"],
        ),
        GaugeMetricFamily(
            "orcapod_vtc_service",
            "A tenant's virtual token counter (VTC): weighted tokens served, "
            "divided by the tenant's weight.",
            labels=["tenant"],
        ),
        GaugeMetricFamily(
            "orcapod_kv_blocks_cached",
            "K/V blocks of a worker caching a prompt prefix (held or evictable).",
            labels=["worker"],
        ),
    )
