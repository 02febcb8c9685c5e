#!/usr/bin/env bash
# Set up (scripts/setup.sh, and Debian's prometheus for one test), then lint, type-check the pure cores and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Debian's prometheus, for the test that scrapes a live service with it
# (tests/test_up.py skips it without one).
if ! command -v prometheus >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
            || echo "note: could not install prometheus; its test will be skipped" >&2
    else
        echo "note: prometheus is not installed; its test will be skipped" \
            "(Debian: sudo apt-get install prometheus)" >&2
    fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check .
ruff format --check .
mypy shared scheduler_actor gpu_worker gateway orcapod
# The slowest tests, so that the suite's time (20 minutes at most on 2 cores) stays visible.
python -m pytest -q --durations=25 "$@"
