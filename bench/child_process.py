"""A benchmark run again as a child process: ``python -m bench.<name>``, which imports
this checkout wherever the child runs (the repo root first on its ``PYTHONPATH``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

REPO_ROOT = Path(__file__).resolve().parents[1]


def module_argv(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args...`` in this Python."""
    return [sys.executable, "-m", module, *args]


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``extra`` and the repo root first on PYTHONPATH."""
    environment = {**os.environ, **(extra or {})}
    paths = [str(REPO_ROOT), *filter(None, environment.get("PYTHONPATH", "").split(os.pathsep))]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return environment


def rerun(module: str, extra_environment: Mapping[str, str]) -> NoReturn:
    """Replace this process by ``python -m module`` with the same arguments, under
    ``extra_environment`` (what the libraries read when they are imported)."""
    os.execve(
        sys.executable, module_argv(module, *sys.argv[1:]), child_environment(extra_environment)
    )
