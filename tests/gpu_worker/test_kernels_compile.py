"""The Triton kernels compile to GPU machine code, on a machine without a GPU.

Triton's interpreter (the other kernel tests) runs the kernels' Python, so it
misses what only the compiler refuses: a global that is not a constexpr (which
once broke the first GPU run), a `tl.dot` smaller than 16, types that do not
unify across a loop. ``kernel_builds.py`` takes each kernel through Triton's
whole NVIDIA pipeline (TTIR, TTGIR, LLVM IR, PTX, then ptxas to a cubin) for
Hopper (sm_90: the H100 and H200) and Ampere (sm_80), with the launch
parameters the engine uses: decode and prefill tiles, bf16 and fp32, the GQA
ratios of Llama 3.2 1B (4) and SmolLM2 (3); and the pointwise kernels.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: Triton read at import, before the interpreter tests set
# TRITON_INTERPRET=1, would make their kernels compiled ones.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from tests.gpu_worker.kernel_builds import ATTENTION_CASES, POINTER_TYPES, POINTWISE_KERNELS

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    *(f"attention {name} {target}" for name, case in ATTENTION_CASES.items() for target in case[3]),
    *(f"write_kv {dtype} sm_90" for dtype in POINTER_TYPES),
    *(f"{kernel} {dtype} sm_90" for kernel in POINTWISE_KERNELS for dtype in POINTER_TYPES),
]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, dict]:
    """Every case's build, compiled in one fresh process with an empty Triton cache."""
    environment = {
        **os.environ,
        "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton-cache")),
        "TRITON_DEFAULT_FP_FUSION": "1",
    }
    environment.pop("TRITON_INTERPRET", None)
    finished = subprocess.run(
        [sys.executable, "-m", "tests.gpu_worker.kernel_builds"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr
    lines = [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line for line in lines}


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_to_a_cubin(builds, case):
    build = builds[case]
    assert build["ok"], build.get("error")
    assert build["cubin_bytes"] > 0
    assert build["ptx_target"].startswith(case.rsplit(" ", 1)[1])
