"""One ``orcapod up`` for the whole adversarial suite (starting one takes ~20 s)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adversarial.service import Service


@pytest.fixture(scope="session")
def service(
    tmp_path_factory: pytest.TempPathFactory, prepared_model_dir: Path
) -> Iterator[Service]:
    running = Service(tmp_path=tmp_path_factory.mktemp("adversarial"), model_dir=prepared_model_dir)
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def every_process_survives(service: Service) -> Iterator[None]:
    """Whatever a test sent, every actor is the process it was, afterwards."""
    service.assert_alive()
    yield
    service.assert_alive()
