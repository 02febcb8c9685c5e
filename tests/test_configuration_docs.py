"""docs/configuration.md against the code: the page is what the parsers make
now, and every environment variable the code reads is on it."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from orcapod import config_docs

ROOT = Path(__file__).resolve().parents[1]
# Not the code: the tests, the docs, and what tools put there.
SKIPPED_DIRS = {"tests", "docs", ".venv", ".git", "__pycache__", "orcapod.egg-info"}
# The page's generator names the variables it documents: no evidence that the code reads them.
SKIPPED_FILES = {ROOT / "orcapod" / "config_docs.py"}
TEXT_SUFFIXES = {".sh", ".yaml", ".yml", ".toml", ".cfg"}
TEXT_NAMES = {"Dockerfile", "Makefile"}
VARIABLE = re.compile(r"\bORCAPOD_[A-Z0-9_]+\b")


def _code_files() -> Iterator[Path]:
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")]
        for name in files:
            path = Path(folder) / name
            if path in SKIPPED_FILES:
                continue
            if path.suffix == ".py" or path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                yield path


def _variables_in_python(source: str) -> tuple[set[str], set[str]]:
    """(every ``ORCAPOD_*`` name in a string of the module, the names its
    ``flag_environment_default(name, ...)`` calls read). Identifiers that only
    look like one (a constant named ``ORCAPOD_RUNS``) are no variable."""
    tree = ast.parse(source)
    named = {
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for name in VARIABLE.findall(node.value)
    }
    # The function, and the local names it goes by (`env = flag_environment_default`).
    readers = {"flag_environment_default"} | {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Name)
        and node.value.id == "flag_environment_default"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    read = {
        f"ORCAPOD_{node.args[0].value.upper()}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in readers
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }
    return named | read, read


def _variables_in_code() -> tuple[dict[str, set[str]], set[str]]:
    """(every ``ORCAPOD_*`` variable -> the files naming it, the variables read
    through ``flag_environment_default``)."""
    where: dict[str, set[str]] = {}
    read_as_flags: set[str] = set()
    for path in _code_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".py":
            names, read = _variables_in_python(text)
            read_as_flags |= read
        else:
            names = set(VARIABLE.findall(text))
        for name in names:
            where.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return where, read_as_flags


def test_the_page_is_what_the_code_makes() -> None:
    page = config_docs.PAGE.read_text(encoding="utf-8")
    assert page == config_docs.render(), (
        f"docs/configuration.md is out of date: run `{config_docs.REGENERATE}`"
    )


def test_every_variable_in_the_code_is_on_the_page() -> None:
    where, read_as_flags = _variables_in_code()
    # What the scan must find, so that it can fail: the one list of the settings
    # module, one read through an alias, one outside Python.
    assert {"ORCAPOD_PREFIX", "ORCAPOD_MAX_CONNECTIONS", "ORCAPOD_LIFELINE_FD"} <= set(where)
    assert "ORCAPOD_CACHE_DIR" in {n for n, files in where.items() if "Dockerfile" in files}
    assert {"ORCAPOD_WEIGHTS", "ORCAPOD_OPEN", "ORCAPOD_REDIS_OUTAGE_LIMIT_S"} <= read_as_flags
    page = config_docs.render()
    on_page = set(re.findall(r"`(ORCAPOD_[A-Z0-9_]+)`", page))
    missing = {name: sorted(files) for name, files in where.items() if name not in on_page}
    assert not missing, f"add these to orcapod/config_docs.py (or a flag's help): {missing}"


def test_each_variable_read_as_a_flag_default_is_shown_with_its_flag() -> None:
    _, read_as_flags = _variables_in_code()
    shown = {flag.variable for section in config_docs.sections() for flag in section.flags} - {None}
    assert read_as_flags <= shown, (
        f"name each as $NAME in the help of the flag it stands for: {sorted(read_as_flags - shown)}"
    )


def test_every_flag_says_what_it_does() -> None:
    for section in config_docs.sections():
        for flag in section.flags:
            assert flag.description, (section.name, flag.names)


def test_the_page_shows_the_code_defaults_whatever_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clean = config_docs.render()
    for name, value in {
        "ORCAPOD_MAX_CONNECTIONS": "5",
        "ORCAPOD_WEIGHTS": "float32",
        "ORCAPOD_COMPILE_DECODE": "0",
        "ORCAPOD_OPEN": "1",
        "REDIS_URL": "redis://elsewhere:6379/0",
    }.items():
        monkeypatch.setenv(name, value)
    assert config_docs.render() == clean
    assert os.environ["ORCAPOD_MAX_CONNECTIONS"] == "5"  # put back as it was
