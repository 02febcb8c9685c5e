"""`orcapod up` gives the scheduler and each worker a metrics port and says where
every actor's /metrics is; the ones it printed answer a real scrape."""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from orcapod.up import free_metrics_ports, metrics_lines
from tests.conftest import free_port
from tests.gpu_worker.tiny_models import write_tiny_model
from tests.up_process import UpProcess

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


def _scrape(url: str, deadline_s: float) -> set[str]:
    """The metric family names at ``url`` (retried until ``deadline_s``)."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            return {family.name for family in text_string_to_metric_families(text)}
        except (urllib.error.URLError, OSError):
            assert time.monotonic() < deadline_s, f"{url} never answered"
            time.sleep(0.2)


def test_up_prints_and_serves_the_actors_metrics(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny", "llama")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = UpProcess(
        [
            *("--port", str(port), "--model", str(model_dir)),
            "--worker-arg=--device=cpu",
            "--worker-arg=--kv-cache-bytes=4194304",
        ],
        env,
    )
    try:
        up.wait_ready()
        time.sleep(0.5)  # the lines after the ready line
        output = up.drain()
        ready_at = next(i for i, line in enumerate(output) if "orcapod is ready" in line)
        # The lines it printed before still come first.
        assert output[ready_at + 1].strip().startswith(f"ws://127.0.0.1:{port}/ws")
        urls = {
            match["name"]: match["url"]
            for line in output[ready_at:]
            if (match := METRICS_LINE.match(line.rstrip("\n")))
        }
        assert set(urls) == {"scheduler", "worker-0", "gateway-0"}
        assert urls["gateway-0"] == f"http://127.0.0.1:{port}/metrics"
        assert urls["scheduler"] != urls["worker-0"]
        deadline_s = time.monotonic() + 30
        assert "orcapod:kv_blocks_total" in _scrape(urls["scheduler"], deadline_s)
        assert "orcapod:step_time_seconds" in _scrape(urls["worker-0"], deadline_s)
    finally:
        up.stop()
