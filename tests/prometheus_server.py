"""Debian's ``prometheus`` as a child of a test, scraping given ``/metrics`` URLs
every second, and its HTTP query API (``/api/v1/query``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.conftest import free_port, stop_process

PROMETHEUS = shutil.which("prometheus")


class PrometheusServer:
    """A running Prometheus on loopback ``port``."""

    def __init__(self, port: int) -> None:
        self.port = port

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector ``promql`` evaluates to now (``data.result``)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, promql: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """``query`` until it returns a series (Prometheus has scraped by then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = self.query(promql)
                if result:
                    return result
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline, f"no series for {promql}"
            time.sleep(0.25)


@contextmanager
def prometheus_scraping(urls: Sequence[str], workdir: Path) -> Iterator[PrometheusServer]:
    """Prometheus scraping ``urls`` (job ``orcapod``) every second until the block ends."""
    assert PROMETHEUS is not None
    targets = [urllib.parse.urlsplit(url) for url in urls]
    assert {target.path for target in targets} == {"/metrics"}
    config = workdir / "prometheus.yml"
    # JSON is YAML: one scrape job with every target.
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "orcapod",
                        "static_configs": [{"targets": [target.netloc for target in targets]}],
                    }
                ],
            }
        )
    )
    port = free_port()
    with open(workdir / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield PrometheusServer(port)
    finally:
        stop_process(process, timeout_s=10)
