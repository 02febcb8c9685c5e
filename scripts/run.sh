#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the whole service on the embedded SmolLM2:
# a local redis-server, the scheduler, a worker and a gateway on ws://127.0.0.1:8000/ws.
# Extra arguments go to 'orcapod up' (e.g. --workers 2 --gateways 2 --policy orca).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec orcapod up "$@"
