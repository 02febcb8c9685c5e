"""The scheduler's Prometheus metrics (``docs/metrics.md``), shaped like vLLM's.

The gauges are a view of the core, read when Prometheus scrapes: nothing is
copied on the hot loop, so no second copy can drift, and a tenant or worker
the core no longer knows is simply not reported (the totals over tenants are
always there, 0 when idle). Only what the core does not keep as a total is
counted as it happens: the plans sent to each worker and the preemptions they
carry (``plans_sent``, once per turn), and the phases of each request that
ended (``requests_finished``). Every series carries ``model_name``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler_actor.core import Scheduler
from scheduler_actor.request import FinishedRequest
from shared.messages import StepPlan
from shared.metric_buckets import (
    REQUEST_PHASE_BUCKETS_S,
    REQUEST_TOKENS_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS_S,
)
from shared.metrics_labels import labelled_registry


class SchedulerMetrics:
    """One scheduler's registry: its core's state, counters of its plans and
    the phases of the requests that ended; ``model_name`` on every series."""

    def __init__(self, model_name: str = "") -> None:
        own = CollectorRegistry()
        self.registry = labelled_registry(own, {"model_name": model_name})
        self._core_view = _CoreView()
        own.register(self._core_view)
        self._num_plans = Counter(
            "orcapod_plans",
            "Step plans sent to a worker (rate(): plans per second).",
            ["worker"],
            registry=own,
        )
        self._num_preemptions = Counter(
            "orcapod_num_preemptions",
            "Requests taken off a worker to be recomputed later (K/V ran out).",
            registry=own,
        )
        self._phases = _RequestPhases(own)

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

    def requests_finished(self, finished: Sequence[FinishedRequest]) -> None:
        """Observe the phases and lengths of requests that ended."""
        for request in finished:
            self._phases.observe(request)


class _RequestPhases:
    """vLLM's per-request histograms, as the scheduler saw each request:
    queued (arrival to its first placement), prefill (to its first token),
    decode (first token to the end), inference (first placement to the end),
    the time per output token after the first, and its prompt and generated
    tokens. A request that ended with an error is not observed; a phase whose
    start this scheduler incarnation did not see (a request recovered after a
    restart, with tokens already sent) is left out."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def phase(name: str, meaning: str) -> Histogram:
            return Histogram(name, meaning, buckets=REQUEST_PHASE_BUCKETS_S, registry=registry)

        self._queue = phase(
            "orcapod_request_queue_time_seconds",
            "From a request's arrival at the scheduler to its first placement on a worker.",
        )
        self._prefill = phase(
            "orcapod_request_prefill_time_seconds",
            "From a request's first placement to its first token.",
        )
        self._decode = phase(
            "orcapod_request_decode_time_seconds",
            "From a request's first token to its end.",
        )
        self._inference = phase(
            "orcapod_request_inference_time_seconds",
            "From a request's first placement to its end (prefill and decode).",
        )
        self._per_output_token = Histogram(
            "orcapod_request_time_per_output_token_seconds",
            "A request's decode time divided by its tokens after the first.",
            buckets=TIME_PER_OUTPUT_TOKEN_BUCKETS_S,
            registry=registry,
        )
        self._prompt_tokens = Histogram(
            "orcapod_request_prompt_tokens",
            "Prompt tokens of a request that ended.",
            buckets=REQUEST_TOKENS_BUCKETS,
            registry=registry,
        )
        self._generation_tokens = Histogram(
            "orcapod_request_generation_tokens",
            "Tokens generated for a request that ended.",
            buckets=REQUEST_TOKENS_BUCKETS,
            registry=registry,
        )

    def observe(self, request: FinishedRequest) -> None:
        if request.finish_reason == "error":
            return
        self._prompt_tokens.observe(request.num_prompt_tokens)
        num_generated = len(request.token_ids)
        self._generation_tokens.observe(num_generated)
        scheduled_s, first_token_s = request.first_scheduled_s, request.first_token_s
        if scheduled_s is None:
            return  # cancelled before it was ever placed
        self._queue.observe(scheduled_s - request.arrival_s)
        self._inference.observe(request.finish_s - scheduled_s)
        if first_token_s is None:
            return
        self._prefill.observe(first_token_s - scheduled_s)
        decode_s = request.finish_s - first_token_s
        self._decode.observe(decode_s)
        if num_generated > 1:
            self._per_output_token.observe(decode_s / (num_generated - 1))


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
        (
            num_waiting,
            num_running,
            waiting,
            running,
            blocks_used,
            pool_blocks,
            usage,
            vtc_service,
            blocks_cached,
        ) = gauges
        counters = _prefix_cache_counters()
        core = self.core
        total_waiting = total_running = 0
        if core is not None:
            # The tenants with a request waiting or running, and their counts,
            # as the tenant ledger (which admission uses) keeps them.
            tenants = core.tenants
            for tenant in tenants.active():
                tenant_waiting, tenant_running = (
                    tenants.num_waiting(tenant),
                    tenants.num_running(tenant),
                )
                waiting.add_metric([tenant], tenant_waiting)
                running.add_metric([tenant], tenant_running)
                total_waiting += tenant_waiting
                total_running += tenant_running
            for worker_id, worker in core.workers.items():
                blocks = worker.ledger
                blocks_used.add_metric([worker_id], blocks.num_used)
                pool_blocks.add_metric([worker_id], blocks.num_blocks)
                usage.add_metric([worker_id], blocks.num_used / blocks.num_blocks)
                blocks_cached.add_metric([worker_id], blocks.num_cached)
            for tenant, counter in core.vtc.counters.items():
                vtc_service.add_metric([tenant], counter)
            stats = core.prefix_cache_stats
            values = (
                stats.num_query_tokens,
                stats.num_hit_tokens,
                stats.num_queries,
                stats.num_hits,
                stats.num_evictions,
            )
            for family, value in zip(counters, values, strict=True):
                family.add_metric([], value)
        num_waiting.add_metric([], total_waiting)
        num_running.add_metric([], total_running)
        yield from gauges
        yield from counters


def _prefix_cache_counters() -> tuple[CounterMetricFamily, ...]:
    return (
        CounterMetricFamily(
            "orcapod_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (vLLM's meaning).",
        ),
        CounterMetricFamily(
            "orcapod_prefix_cache_hits",
            "Prompt tokens whose K/V came from the prefix cache (not computed).",
        ),
        CounterMetricFamily(
            "orcapod_prefix_cache_lookups",
            "Placements that looked up a cached prompt prefix (all workers).",
        ),
        CounterMetricFamily(
            "orcapod_prefix_cache_lookup_hits",
            "Placements that found at least one cached block of their prompt.",
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
            "Requests on no worker (queued, or preempted), all tenants; 0 when idle.",
        ),
        GaugeMetricFamily(
            "orcapod_num_requests_running",
            "Requests placed on a worker, all tenants; 0 when idle.",
        ),
        GaugeMetricFamily(
            "orcapod_tenant_requests_waiting",
            "Requests of a tenant on no worker (queued, or preempted).",
            labels=["tenant"],
        ),
        GaugeMetricFamily(
            "orcapod_tenant_requests_running",
            "Requests of a tenant placed on a worker.",
            labels=["tenant"],
        ),
        GaugeMetricFamily(
            "orcapod_kv_blocks_used",
            "K/V blocks of a worker the scheduler has handed out.",
            labels=["worker"],
        ),
        GaugeMetricFamily(
            "orcapod_kv_pool_blocks",
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
