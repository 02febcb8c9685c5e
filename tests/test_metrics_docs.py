"""docs/metrics.md and docs/grafana/orcapod.json against the metrics the actors
really export: every metric documented, every dashboard query on a real series."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

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


def _actor_series() -> dict[str, str]:
    core = Scheduler(SchedulerConfig(), lambda: 0.0)
    core.worker_joined("w", 16, 4)
    core.submit("r", "t", [1, 2], SamplingParams(max_tokens=2))
    scheduler = SchedulerMetrics()
    scheduler.watch(core)
    plan = core.next_plan("w")
    assert plan is not None
    scheduler.plans_sent([plan], core)
    return {
        **_series(scheduler.registry),
        **_series(WorkerMetrics("w", EngineStats()).registry),
        **_series(GatewayMetrics("g").registry),
    }


def test_every_metric_has_its_row_in_the_docs() -> None:
    text = (DOCS / "metrics.md").read_text()
    rows = {
        match[1]: match[2] for match in re.finditer(r"^\| `(orcapod:\w+)` \| (\w+)", text, re.M)
    }
    series = _actor_series()
    assert len(series) == 29
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
            for name in re.findall(r"orcapod:\w+", target["expr"]):
                base = next(
                    (name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name
                )
                assert name in known or base in histograms, (panel["title"], name)
                queried.add(base if base in histograms else name)
    # Every metric has a panel.
    assert queried == known, known - queried
