"""Settings: the one module that reads environment variables.

Everything is built once at start into frozen dataclasses and passed down.
Environment variables (each overridable by a command-line flag):

- ``ORCAPOD_CACHE_DIR``: where prepared models live (default ``~/.cache/orcapod``).
- ``ORCAPOD_MODEL``: a Hugging Face-format model directory to serve instead of
  the embedded SmolLM2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelLocation:
    """Where the model to load is, and where prepared models are cached."""

    cache_dir: Path
    model_dir: Path

    @property
    def is_embedded(self) -> bool:
        """True when ``model_dir`` is the prepared embedded default."""
        return self.model_dir == embedded_model_dir(self.cache_dir)


def embedded_model_dir(cache_dir: Path) -> Path:
    """The HF-format directory ``orcapod model prepare`` writes."""
    return cache_dir / "models" / EMBEDDED_MODEL_NAME


def model_location(
    *,
    model_dir: str | None = None,
    cache_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ModelLocation:
    """Resolve flags first, then environment, then defaults."""
    env = os.environ if environ is None else environ
    cache = Path(cache_dir or env.get("ORCAPOD_CACHE_DIR") or Path.home() / ".cache" / "orcapod")
    cache = cache.expanduser()
    chosen = model_dir or env.get("ORCAPOD_MODEL")
    model = Path(chosen).expanduser() if chosen else embedded_model_dir(cache)
    return ModelLocation(cache_dir=cache, model_dir=model)
