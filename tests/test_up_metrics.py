"""`orcapod up` gives the scheduler and each worker a metrics port and says where
every actor's /metrics is (tests/test_up.py scrapes the ones a real `orcapod up`
printed)."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from orcapod.up import free_metrics_ports, metrics_lines

METRICS_LINE = re.compile(r"^\s+(?P<name>[a-z]+-?\d*)\s+(?P<url>http://\S+/metrics)$")


def test_metrics_lines_name_every_actor() -> None:
    lines = metrics_lines(9100, [9101, 9102], "0.0.0.0", [8000, 8001])
    assert lines == [
        "  metrics (Prometheus):",
        "    scheduler  http://127.0.0.1:9100/metrics",
        "    worker-0   http://127.0.0.1:9101/metrics",
        "    worker-1   http://127.0.0.1:9102/metrics",
        "    gateway-0  http://0.0.0.0:8000/metrics",
        "    gateway-1  http://0.0.0.0:8001/metrics",
    ]


def test_free_metrics_ports_are_distinct_and_avoid_the_taken_ones() -> None:
    taken = set(free_metrics_ports(5, set()))
    ports = free_metrics_ports(20, taken)
    assert len(set(ports)) == 20 and not taken & set(ports)


def scrape_families(url: str, deadline_s: float) -> set[str]:
    """The metric family names at ``url`` (retried until ``deadline_s``)."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            return {family.name for family in text_string_to_metric_families(text)}
        except (urllib.error.URLError, OSError):
            assert time.monotonic() < deadline_s, f"{url} never answered"
            time.sleep(0.2)
