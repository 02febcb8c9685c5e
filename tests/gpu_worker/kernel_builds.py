"""Compile the Triton kernels for NVIDIA targets, without a GPU: one JSON line per case.

    python -m tests.gpu_worker.kernel_builds

Run in a fresh process by test_kernels_compile.py: Triton's interpreter (the
other kernel tests, ``TRITON_INTERPRET=1``) patches ``triton.language`` in the
process it runs in, and a compile there fails for that reason alone.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

# Triton and the kernels are imported by the functions that compile: a test that only
# reads the cases below must not import the kernels (whether they are interpreted is
# fixed when they are imported).
TARGETS = {"sm_90": 90, "sm_80": 80}  # compute capabilities
POINTER_TYPES = {"bfloat16": "*bf16", "float32": "*fp32"}
# name: (dtype, tile tokens, queries per kv head, targets)
ATTENTION_CASES = {
    "decode bf16 gqa 4": ("bfloat16", 1, 4, ["sm_90"]),
    "prefill bf16 gqa 4": ("bfloat16", 16, 4, ["sm_90", "sm_80"]),
    "decode bf16 gqa 3": ("bfloat16", 1, 3, ["sm_90"]),
    "prefill fp32 gqa 1": ("float32", 16, 1, ["sm_90"]),
}


def compile_kernel(
    kernel: Any, pointers: dict[str, str], constants: dict[str, Any], target: str
) -> Any:
    """Compile ``kernel`` for ``target`` (``sm_90``): pointer args typed by ``pointers``,
    constexprs from ``constants``, ``scale_log2`` and ``eps`` fp32, every other one an i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = set(constants) - set(kernel.arg_names)
    assert not missing, f"not arguments of the kernel: {missing}"
    signature, constexprs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constants:
            signature[name] = "constexpr"
            constexprs[(index,)] = constants[name]
        else:
            signature[name] = "fp32" if name in ("scale_log2", "eps") else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", TARGETS[target], 32))


def attention_build(dtype: str, tile_tokens: int, queries_per_kv: int, target: str) -> Any:
    from gpu_worker import attention_triton

    group_padded = 1 << (queries_per_kv - 1).bit_length()
    element = POINTER_TYPES[dtype]
    pointers = {
        **dict.fromkeys(["output_ptr", "query_ptr", "key_pool_ptr", "value_pool_ptr"], element),
        "requests_ptr": "*i32",
        "tiles_ptr": "*i32",
    }
    constants = dict(
        BLOCK_SIZE=16,
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PADDED=group_padded,
        BLOCK_Q=tile_tokens,
        BLOCK_M=max(16, tile_tokens * group_padded),
        BLOCK_N=64,
        HEAD_DIM=64,
        HEAD_DIM_PADDED=64,
        DOT_IN_FP32=dtype == "float32",
    )
    kernel = attention_triton._paged_attention_kernel
    return compile_kernel(kernel, pointers, constants, target)


def write_kv_build(dtype: str) -> Any:
    from gpu_worker import kv_write_triton

    element = POINTER_TYPES[dtype]
    pointers = {
        **dict.fromkeys(["key_ptr", "value_ptr", "key_pool_ptr", "value_pool_ptr"], element),
        "slot_mapping_ptr": "*i64",
    }
    constants = dict(NUM_KV_HEADS=3, HEADS_PADDED=4, HEAD_DIM=64, HEAD_DIM_PADDED=64)
    kernel = kv_write_triton._write_kv_kernel
    return compile_kernel(kernel, pointers, constants, "sm_90")


def pointwise_build(kernel_name: str, dtype: str) -> Any:
    """The kernels of ``pointwise_triton.py`` at Llama 3.2 1B's sizes."""
    from gpu_worker import pointwise_triton

    element = POINTER_TYPES[dtype]
    if kernel_name == "add_rms_norm":
        kernel = pointwise_triton._add_rms_norm_kernel
        pointers = dict.fromkeys(["hidden_ptr", "delta_ptr", "weight_ptr", "normed_ptr"], element)
        constants: dict[str, Any] = dict(HAS_DELTA=True, BLOCK=2048)
    elif kernel_name == "rope_and_store_kv":
        kernel = pointwise_triton._rope_and_store_kv_kernel
        pointers = {
            **dict.fromkeys(["qkv_ptr", "cos_ptr", "sin_ptr", "query_ptr"], element),
            **dict.fromkeys(["key_pool_ptr", "value_pool_ptr"], element),
            "positions_ptr": "*i64",
            "slot_mapping_ptr": "*i64",
        }
        constants = dict(
            NUM_HEADS=32, NUM_KV_HEADS=8, HEADS_PADDED=32, KV_HEADS_PADDED=8,
            HEAD_DIM=64, HEAD_DIM_PADDED=64,
        )  # fmt: skip
    else:
        kernel = pointwise_triton._silu_mul_kernel
        pointers = dict.fromkeys(["gate_up_ptr", "output_ptr"], element)
        constants = dict(BLOCK=1024)
    signature_pointers = {name: pointers[name] for name in kernel.arg_names if name in pointers}
    return compile_kernel(kernel, signature_pointers, constants, "sm_90")


POINTWISE_KERNELS = ("add_rms_norm", "rope_and_store_kv", "silu_mul")


def report(case: str, build: Any) -> None:
    """Print ``{"case", "ok", "cubin_bytes", "ptx_target", "error"}`` for one build."""
    line: dict[str, Any] = {"case": case}
    try:
        compiled = build()
        ptx_targets = [w for w in compiled.asm["ptx"].split() if w.startswith("sm_")]
        line.update(ok=True, cubin_bytes=len(compiled.asm["cubin"]), ptx_target=ptx_targets[0])
    except Exception:
        line.update(ok=False, error=traceback.format_exc(limit=-3))
    print(json.dumps(line), flush=True)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels do not compile", file=sys.stderr)
        return 2
    for name, (dtype, tile_tokens, queries_per_kv, targets) in ATTENTION_CASES.items():
        for target in targets:
            report(
                f"attention {name} {target}",
                lambda d=dtype, t=tile_tokens, q=queries_per_kv, g=target: attention_build(
                    d, t, q, g
                ),
            )
    for dtype in POINTER_TYPES:
        report(f"write_kv {dtype} sm_90", lambda d=dtype: write_kv_build(d))
        for kernel_name in POINTWISE_KERNELS:
            report(
                f"{kernel_name} {dtype} sm_90",
                lambda k=kernel_name, d=dtype: pointwise_build(k, d),
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
