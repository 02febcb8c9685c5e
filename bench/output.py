"""Where a benchmark's results go and how it writes them: ``RESULTS_DIR`` (not
committed), one JSON document per run, progress lines on stderr, PASS/FAIL lines."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Relative: benchmarks run from the repo root (python -m bench.<name>).
RESULTS_DIR = Path("bench/results")


def log(message: str) -> None:
    """A progress line on stderr (stdout keeps the tables)."""
    print(message, file=sys.stderr, flush=True)


def write_json(path: Path, document: Any, indent: int = 2) -> Path:
    """``document`` as JSON at ``path``, its folder made if missing; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=indent) + "\n", encoding="utf-8")
    return path


def print_checks(checks: Mapping[str, bool]) -> None:
    """One ``PASS``/``FAIL`` line per check."""
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
