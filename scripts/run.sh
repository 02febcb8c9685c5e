#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the engine on the embedded SmolLM2 with a
# batch of chat prompts. Extra arguments go to 'orcapod generate'.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
    set -- "What is the capital of France?" "Write a haiku about the sea." \
        "Explain in two sentences why the sky is blue." --max-tokens 64
fi
exec orcapod generate "$@"
