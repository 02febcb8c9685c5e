#!/usr/bin/env bash
# Set up (scripts/setup.sh), then lint, type-check the pure cores and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check .
ruff format --check .
mypy shared scheduler_actor gpu_worker gateway orcapod
# The slowest tests, so that the suite's time (20 minutes at most on 2 cores) stays visible.
python -m pytest -q --durations=25 "$@"
