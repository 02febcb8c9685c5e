"""docs/metrics.md and docs/grafana/orcapod.json against the metrics the actors
really export: every metric documented, every dashboard query on a real series."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gateway.metrics import GatewayMetrics
from gpu_worker.engine import EngineStats
from gpu_worker.metrics import WorkerMetrics
from scheduler_actor.config import SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.metrics import SchedulerMetrics
from shared.messages import SamplingParams

DOCS = Path(__file__).resolve().parents[1] / "docs"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _series(registry: CollectorRegistry) -> dict[str, str]:
    """Documented name (histograms whole, counters with ``_total``) -> type."""
    names: dict[str, str] = {}
    for family in registry.collect():
        if family.type == "counter":
            names[f"{family.name}_total"] = family.type
        elif family.type in ("gauge", "histogram"):
            names[family.name] = family.type
    return {name: kind for name, kind in names.items() if not name.endswith("_created")}


def _actor_registries() -> list[CollectorRegistry]:
    """The scheduler's, a worker's and a gateway's registries, each family with a sample."""
    core = Scheduler(SchedulerConfig(), lambda: 0.0)
    core.worker_joined("w", 16, 4)
    core.submit("r", "t", [1, 2], SamplingParams(max_tokens=2))
    scheduler = SchedulerMetrics()
    scheduler.watch(core)
    plan = core.next_plan("w")
    assert plan is not None
    scheduler.plans_sent([plan], core)
    return [
        scheduler.registry,
        WorkerMetrics("w", EngineStats()).registry,
        GatewayMetrics("g").registry,
    ]


def _actor_series() -> dict[str, str]:
    return {
        name: kind for registry in _actor_registries() for name, kind in _series(registry).items()
    }


def test_every_metric_has_its_row_in_the_docs() -> None:
    text = (DOCS / "metrics.md").read_text()
    rows = {
        match[1]: match[2] for match in re.finditer(r"^\| `(orcapod_\w+)` \| (\w+)", text, re.M)
    }
    series = _actor_series()
    assert len(series) == 40
    for name, kind in series.items():
        assert rows.get(name) == kind, name
    assert set(rows) == set(series)  # no row for a metric that is not


def test_the_dashboard_queries_only_real_series() -> None:
    dashboard = json.loads((DOCS / "grafana" / "orcapod.json").read_text())
    [variable] = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    known = set(_actor_series())
    histograms = {name for name, kind in _actor_series().items() if kind == "histogram"}
    queried: set[str] = set()
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"orcapod_\w+", target["expr"]):
                base = next(
                    (name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name
                )
                assert name in known or base in histograms, (panel["title"], name)
                queried.add(base if base in histograms else name)
    # Every metric has a panel.
    assert queried == known, known - queried


# What Prometheus 2.x (2.42, compose's v2.53.0) and 3.x send: 2.x asks for
# OpenMetrics first, whose writer (prometheus_client >= 0.23) escapes colons in
# names; 3.x allows UTF-8 names.
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.5,*/*;q=0.1"
)


def test_prometheus_2_and_3_store_the_documented_names() -> None:
    """Every name a scrape declares is one the docs and the dashboard use, whichever
    format the scraper's Accept header picks (a name with a colon came out as
    another under Prometheus 2.x: every query of the docs returned nothing)."""
    documented = set(_actor_series())
    families = {name.removesuffix("_total") for name in documented}
    for accept in (PROMETHEUS_2_ACCEPT, PROMETHEUS_3_ACCEPT, "text/plain"):
        for registry in _actor_registries():
            encoder, _ = choose_encoder(accept)
            text = encoder(registry).decode()
            declared = re.findall(r"^# TYPE (\S+) ", text, re.M)
            sampled = re.findall(r"^([^#\s{]+)", text, re.M)
            assert declared and sampled, accept
            for name in [*declared, *sampled]:
                family = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
                assert family in families, (accept, name)
