#!/usr/bin/env bash
# GPU numbers for docs/performance.md ("GPU"), in one run of under 8 minutes on one CUDA GPU:
#   1. python -m bench.gpu: copy bandwidth and bf16 matmul rate (the ceilings), a triton-vs-reference
#      check, decode step time for batch 1..256 x context 256..4096 (1B-class Llama and
#      SmolLM2-135M shapes, random bf16 weights; eager and CUDA graphs) against the
#      bandwidth floor, and the CPU launch cost of a graph step;
#   2. `orcapod bench` end to end at three rates against `orcapod up` (embedded SmolLM2).
# Writes bench/results/gpu.json and gpu_e2e.json (or $RESULTS_DIR) and prints the table last.
#
#   bench/gpu.sh            # full run
#   QUICK=1 bench/gpu.sh    # a smoke run (fewer points, shorter end to end)
#   E2E_ONLY=1 bench/gpu.sh # only part 2, the end-to-end run
#   MODEL_DIR=DIR bench/gpu.sh   # end to end on that model (default: the embedded SmolLM2);
#                                # python -m bench.random_checkpoint fills a folder with random weights
#
# On a machine without CUDA it says so and exits 0: nothing is measured.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
RESULTS_DIR=${RESULTS_DIR:-bench/results}
PORT=${PORT:-8765}
RATES=${RATES:-2,8,32}
E2E_DURATION_S=${E2E_DURATION_S:-20}

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: GPU numbers not measured"
    exit 0
fi
mkdir -p "$RESULTS_DIR"
quick_flag=()
if [[ -n "${QUICK:-}" ]]; then
    quick_flag=(--quick)
    E2E_DURATION_S=10
fi

table="$RESULTS_DIR/gpu_table.md"
if [[ -z "${E2E_ONLY:-}" ]]; then
    echo "== 1/2 kernels and decode steps (python -m bench.gpu) =="
    # Time limits (240 + 90 + 150 s) keep the whole script under 8 minutes even if a part hangs.
    rm -f "$table"
    if ! timeout 240 "$PYTHON" -m bench.gpu ${quick_flag[@]+"${quick_flag[@]}"} \
        --out "$RESULTS_DIR/gpu.json" --table-out "$table"; then
        echo "python -m bench.gpu failed or ran out of time (see above)"
    fi
fi

echo "== 2/2 end to end (orcapod bench) =="
if ! "$PYTHON" -m orcapod bench --help >/dev/null 2>&1; then
    echo "orcapod bench is not available: end-to-end run skipped"
else
    up_log="$RESULTS_DIR/gpu_up.log"
    model_flag=()
    if [[ -n "${MODEL_DIR:-}" ]]; then
        model_flag=(--model "$MODEL_DIR")
        echo "model: $MODEL_DIR"
    fi
    # One open tenant sends everything: its cap of live requests per gateway (256 by
    # default, a fairness limit) would refuse most of the top rate's requests, so the
    # run measures the service's ceiling with it raised.
    "$PYTHON" -m orcapod up --port "$PORT" ${model_flag[@]+"${model_flag[@]}"} \
        --worker-arg=--cuda-graphs --gateway-arg=--max-requests-per-tenant=8192 \
        >"$up_log" 2>&1 &
    up_pid=$!
    # Stop the service (ordered shutdown on SIGTERM) however this script ends.
    trap 'kill -TERM "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true' EXIT
    ready=""
    for _ in $(seq 1 90); do
        if "$PYTHON" -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$PORT/healthz', timeout=1)" 2>/dev/null; then
            ready=1
            break
        fi
        if ! kill -0 "$up_pid" 2>/dev/null; then
            break
        fi
        sleep 1
    done
    if [[ -z "$ready" ]]; then
        echo "orcapod up did not become healthy in 90 s (see $up_log): end-to-end run skipped"
    else
        timeout 150 "$PYTHON" -m orcapod bench --url "ws://127.0.0.1:$PORT/ws" --rates "$RATES" \
            --duration "$E2E_DURATION_S" --drain-timeout 20 --policy fair \
            --out "$RESULTS_DIR/gpu_e2e.json" --no-progress \
            || echo "orcapod bench failed or ran out of time (see above)"
    fi
    kill -TERM "$up_pid" 2>/dev/null || true
    wait "$up_pid" 2>/dev/null || true
    trap - EXIT
fi

echo
echo "== GPU results ($RESULTS_DIR/gpu.json; end to end: $RESULTS_DIR/gpu_e2e.json) =="
if [[ -f "$table" ]]; then
    cat "$table"
else
    echo "no table: python -m bench.gpu did not finish"
fi
