#!/usr/bin/env bash
# One GPU benchmark run of orcapod on a lent, offline machine (no network), from a carry bundle
# that bench/gpu_bundle.sh builds (default: .devrun in the repo root).
#
#   bash bench/gpu_offline.sh [BUNDLE_DIR]       # or GPU_BUNDLE_DIR=DIR; default <repo>/.devrun
#   bash .devrun/go.sh                           # the same: the bundle's go.sh calls this script
#   E2E_ONLY=1 bash .devrun/go.sh                # only the end-to-end part of bench/gpu.sh
#   QUICK=1 / RATES=2,32,256 (the default)       # passed to bench/gpu.sh as they are
#
# On the device: the run tool with carry [".devrun"], timeout_s 600.
#
# 1. installs the carried wheels (msgspec, structlog, websockets, redis, gguf) into /tmp/site
#    (cp312 wheels: needs a Python 3.12, torch and triton already installed there);
# 2. puts the carried Debian redis-server on PATH and lib/ (liblzf, libjemalloc) on
#    LD_LIBRARY_PATH; only if it still does not run, a redis-only wrapper adds lib/extra (Debian
#    12's libstdc++, libssl, libsystemd, ...: never global, they would shadow newer system ones
#    under torch); then checks the Python imports;
# 3. fills a temp copy of BUNDLE/model (SmolLM2-135M's config + tokenizer) with random bf16
#    weights (python -m bench.random_checkpoint);
# 4. runs bench/gpu.sh (its python -m bench.gpu run includes the correctness checks that
#    `python -m bench.gpu --checks-only` would run, so they are not run twice) with RATES=2,32,256 unless
#    RATES is set; E2E_ONLY and QUICK go through to it.
#
# Output (at most 8 files, 2 levels): $OUT/setup_log.txt, $OUT/gpu_log.txt,
# $OUT/results/{gpu.json,gpu_table.md,gpu_e2e.json,gpu_up.log}. OUT defaults to /tmp/out.
# GPU_SH_LIMIT (default 420 s) caps bench/gpu.sh as a whole (its process group is stopped then).
# PY (default python3) is the Python used; SITE (default /tmp/site) where the wheels go.
# Without CUDA, bench/gpu.sh says "no CUDA device" and exits 0: nothing is measured.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || exit 1
# The bundle: first argument, else GPU_BUNDLE_DIR, else .devrun in the repo root (a relative
# path is taken from the caller's directory).
DEVRUN=${1:-${GPU_BUNDLE_DIR:-$REPO/.devrun}}
if ! DEVRUN=$(cd "$DEVRUN" 2>/dev/null && pwd); then
    echo "gpu_offline.sh: bundle folder '${1:-${GPU_BUNDLE_DIR:-$REPO/.devrun}}' not found" \
        "(build it with bench/gpu_bundle.sh)" >&2
    exit 2
fi
for need in wheels bin/redis-server model/config.json; do
    if [[ ! -e "$DEVRUN/$need" ]]; then
        echo "gpu_offline.sh: $DEVRUN has no $need: not a bundle of bench/gpu_bundle.sh" >&2
        exit 2
    fi
done
cd "$REPO" || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
OUT=$(cd "$OUT" && pwd)
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
GPU_SH_LIMIT=${GPU_SH_LIMIT:-420}
RATES=${RATES:-2,32,256}
start_s=$SECONDS
failed=()

step() { echo; echo "=== [$((SECONDS - start_s)) s] $* ==="; }

# Everything before bench/gpu.sh also goes to $OUT/setup_log.txt.
exec 3>&1 4>&2
exec > >(tee "$OUT/setup_log.txt") 2>&1

step "0/4 machine"
echo "repo: $REPO  bundle: $DEVRUN  out: $OUT  python: $(command -v "$PY")"
"$PY" -c 'import sys, platform; print("python", sys.version.split()[0], platform.machine())' || true
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""); print("triton", triton.__version__)' \
    || echo "WARNING: torch/triton import failed"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi

step "1/4 install carried wheels into $SITE"
ls "$DEVRUN"/wheels/*.whl
if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$DEVRUN"/wheels/*.whl; then
    echo "wheels: installed"
else
    echo "FAILED: pip install of the carried wheels"
    failed+=(wheels)
fi
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$DEVRUN/bin:$PATH"
# Only liblzf and libjemalloc here: redis-specific, so they cannot shadow a library torch uses.
export LD_LIBRARY_PATH="$DEVRUN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "PYTHONPATH=$PYTHONPATH"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

step "2/4 checks: redis-server and Python imports"
chmod +x "$DEVRUN/bin/redis-server" 2>/dev/null || true
# DEVRUN_FORCE_REDIS_WRAPPER=1 takes the lib/extra path below even when it is not needed (a test).
if [[ -n "${DEVRUN_FORCE_REDIS_WRAPPER:-}" ]] || ! redis-server --version; then
    # A library the machine lacks (ldd says which): use the carried Debian ones (lib/extra),
    # but for redis-server alone, through a wrapper first on PATH.
    echo "redis-server with the system's libraries: failed (or DEVRUN_FORCE_REDIS_WRAPPER); ldd says:"
    ldd "$DEVRUN/bin/redis-server" 2>&1 | grep -i 'not found' || true
    wrap=/tmp/devrun-redis-wrapper
    mkdir -p "$wrap"
    cat >"$wrap/redis-server" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$DEVRUN/lib:$DEVRUN/lib/extra\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$DEVRUN/bin/redis-server" "\$@"
EOF
    chmod +x "$wrap/redis-server"
    export PATH="$wrap:$PATH"
    if redis-server --version; then
        echo "redis-server: OK through $wrap/redis-server (with lib/extra)"
    else
        echo "FAILED: redis-server does not run even with lib/extra"
        failed+=(redis-server)
    fi
fi
echo "redis-server on PATH: $(command -v redis-server)"
if "$PY" - <<'PYEOF'
import importlib, sys, traceback
bad = []
for name in ("msgspec", "structlog", "websockets", "redis", "gguf", "orcapod", "gateway",
             "gpu_worker", "scheduler_actor", "shared"):
    try:
        module = importlib.import_module(name)
        print(f"import {name}: OK {getattr(module, '__version__', '')} "
              f"({getattr(module, '__file__', '')})")
    except Exception:
        bad.append(name)
        print(f"import {name}: FAILED")
        traceback.print_exc(limit=3)
sys.exit(1 if bad else 0)
PYEOF
then
    echo "imports: all OK"
else
    echo "FAILED: python imports (see above)"
    failed+=(imports)
fi
# bench/gpu.sh silently skips the end-to-end part when this fails: show why here.
if ! "$PY" -m orcapod bench --help >/dev/null 2>/tmp/devrun-bench-help.err; then
    echo "FAILED: '$PY -m orcapod bench --help' (gpu.sh would skip the end-to-end run):"
    tail -n 30 /tmp/devrun-bench-help.err
    failed+=(orcapod-bench)
else
    echo "orcapod bench: available"
fi

step "3/4 random weights for SmolLM2-135M (python -m bench.random_checkpoint)"
MODEL_TMP=$(mktemp -d /tmp/devrun-model.XXXXXX)
cp "$DEVRUN"/model/* "$MODEL_TMP"/
if "$PY" -m bench.random_checkpoint "$MODEL_TMP" --dtype bfloat16 --seed 0; then
    ls -la "$MODEL_TMP"
else
    # MODEL_DIR stays set: without weights `orcapod up` fails and gpu.sh skips the end-to-end
    # part (the embedded model cannot be prepared here: no network).
    echo "FAILED: python -m bench.random_checkpoint"
    failed+=(random-checkpoint)
fi

step "4/4 bench/gpu.sh (RATES=$RATES${E2E_ONLY:+ E2E_ONLY=$E2E_ONLY}${QUICK:+ QUICK=$QUICK}; limit ${GPU_SH_LIMIT} s)"
# Back to the plain output: gpu.sh's own log is $OUT/gpu_log.txt.
exec 1>&3 2>&4
sleep 0.2
gpu_cmd=(env MODEL_DIR="$MODEL_TMP" PYTHON="$PY" RESULTS_DIR="$OUT/results" RATES="$RATES"
    E2E_ONLY="${E2E_ONLY:-}" QUICK="${QUICK:-}" bash bench/gpu.sh)
if command -v setsid >/dev/null 2>&1; then
    gpu_cmd=(setsid "${gpu_cmd[@]}")
fi
"${gpu_cmd[@]}" > >(tee "$OUT/gpu_log.txt") 2>&1 &
gpu_pid=$!
(
    trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM
    sleep "$GPU_SH_LIMIT" &
    sleeper=$!
    wait "$sleeper"
    echo "gpu_offline.sh: bench/gpu.sh ran past ${GPU_SH_LIMIT} s: stopping it" >&3
    pgid=$(ps -o pgid= "$gpu_pid" 2>/dev/null | tr -d ' ')
    target=("$gpu_pid")
    [[ -n "$pgid" && "$pgid" == "$gpu_pid" ]] && target=(-- "-$pgid")
    kill -TERM "${target[@]}" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$gpu_pid" 2>/dev/null || exit 0; sleep 1; done
    kill -KILL "${target[@]}" 2>/dev/null
) </dev/null >/dev/null 2>&1 &
watchdog=$!
wait "$gpu_pid"
gpu_rc=$?
kill "$watchdog" 2>/dev/null
wait "$watchdog" 2>/dev/null
sleep 0.5  # let tee flush
echo "bench/gpu.sh exited with $gpu_rc"
# Workers run in their own process groups: stop any that outlived gpu.sh (they name
# $MODEL_TMP on their command line, which nothing else on the machine does).
leftover_pids() {
    local f pid
    for f in /proc/[0-9]*/cmdline; do
        pid=${f#/proc/}; pid=${pid%/cmdline}
        [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
        tr '\0' ' ' 2>/dev/null <"$f" | grep -qF -- "$MODEL_TMP" && echo "$pid"
    done
}
mapfile -t left < <(leftover_pids)
if ((${#left[@]})); then
    echo "stopping leftover processes of the run: ${left[*]}"
    kill -TERM "${left[@]}" 2>/dev/null
    for _ in $(seq 1 10); do [[ -z "$(leftover_pids)" ]] && break; sleep 1; done
    mapfile -t left < <(leftover_pids)
    ((${#left[@]})) && kill -KILL "${left[@]}" 2>/dev/null
fi
[[ $gpu_rc -eq 0 ]] || failed+=("gpu.sh rc=$gpu_rc")

echo
echo "=== [$((SECONDS - start_s)) s] wrap up ==="
up_log="$OUT/results/gpu_up.log"
if [[ -f "$up_log" ]]; then
    lines=$(wc -l <"$up_log")
    if ((lines > 2000)); then
        tail -n 2000 "$up_log" >"$up_log.tmp" && mv "$up_log.tmp" "$up_log"
        echo "gpu_up.log: kept the last 2000 of $lines lines"
    fi
    echo "--- last 20 lines of gpu_up.log ---"
    tail -n 20 "$up_log"
fi
rm -rf "$MODEL_TMP"
echo "--- files under $OUT ---"
find "$OUT" -type f -printf '%p %s\n' | sort
if ((${#failed[@]})); then
    echo "gpu_offline.sh: FAILED steps: ${failed[*]}"
else
    echo "gpu_offline.sh: all steps OK"
fi
echo "gpu_offline.sh: took $((SECONDS - start_s)) s"
