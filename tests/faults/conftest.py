"""The ``cluster`` fixture: a service of real processes, stopped after the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.cluster import Cluster


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, prepared_model_dir: Path
) -> Iterator[Cluster]:
    service = Cluster(tmp_path=tmp_path, model_dir=prepared_model_dir)
    try:
        yield service
    finally:
        service.stop()
        report = getattr(request.node, "rep_call", None)
        if report is None or report.failed:
            service.dump_logs()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
