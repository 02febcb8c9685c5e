"""Candidate CPU kernels for one decode token's layer matrices, side by side.

    python -m bench.cpu_kernels [--threads 2] [--calls 500] [--emulate-avx2]
                                [--rows 1,4,16,64,512] [--out FILE.json]

What a lone decode step reads from its 30 layers, one kernel at a time: each of
SmolLM2-135M's four layer matrices (q/k/v fused, o, gate/up fused, down) at one
row of activations, on random weights on llama.cpp's Q4_1 grid (a scale and a
minimum per 32 values, as the packaged model's layers), in every form this CPU
can run:

- ``float32``: ``F.linear`` (the exact mode);
- ``float16 fbgemm``: fbgemm's fp16 kernel, as ``--weights float16`` runs eagerly;
- ``float16 loop``: the products and sum that inductor fuses, as the compiled
  decode reads a float16 layer (one compiled function per matrix, so its
  Python wrapper is counted);
- ``int4 torch``: ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations), as
  ``--weights int4`` runs;
- ``q4_1 orcapod``: the project's own kernel (``gpu_worker/csrc/q4_1_linear.cpp``,
  AVX2 code on every CPU), as ``--weights q4_1`` runs, eager and compiled alike;
- ``q4_1_i16 orcapod``: the same kernel file's form with x rounded to int16 per
  32 values and the products in integers, as ``--weights q4_1_i16`` runs (its
  error is x's rounding, not fp32's);
- ``onnxruntime 4-bit``: ONNX Runtime's ``MatMulNBits`` with 4-bit integer zero
  points and int8 compute (``accuracy_level`` 4): Q4_1's minimum rounded to a
  whole level, so not exact;
- ``onnxruntime float zero``: the same op with Q4_1's minimum as a float zero
  point (exact up to rounding);
- ``numba``: an exact Q4_1 loop (rows as vector lanes) compiled by numba.

The last three run only where ``onnxruntime``/``onnx`` and ``numba`` import;
they are not orcapod's dependencies (``pip install --target DIR onnxruntime
onnx numba`` and ``PYTHONPATH=DIR``). ``--emulate-avx2`` reruns the script with
``ATEN_CPU_CAPABILITY=avx2`` (torch's kernels and inductor's code), fbgemm,
oneDNN and MKL held to AVX2 and ``NUMBA_CPU_NAME=haswell``, on an AVX-512 CPU;
ONNX Runtime picks its kernels from ``cpuid`` and cannot be held to AVX2, so
its rows say ``native``.

``--rows`` also times calls of more rows (a batch of decodes, a prefill chunk)
for the forms that take any number (``float32``, ``float16 fbgemm``, ``q4_1
orcapod``, ``q4_1_i16 orcapod``), each row count in rows of its own.

Prints the median time a call, GB/s of the form's bytes, the largest error
against the fp32 product (relative to the largest output) and the sum for 30
layers; writes JSON. Never run by the test suite.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.child_process import rerun
from bench.output import RESULTS_DIR, log, write_json

GROUP = 32
LAYERS = 30
# SmolLM2-135M: hidden 576, 9 query heads and 3 K/V heads of 64, MLP 1536.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "NUMBA_CPU_NAME": "haswell",
    "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt,+bmi,+bmi2",
    # inductor's kernels for another ISA must not share the AVX-512 ones' cache.
    "TORCHINDUCTOR_CACHE_DIR": str(Path.home() / ".cache" / "orcapod" / "inductor-avx2-bench"),
}

Kernel = Callable[[Any], Any]
# The forms that take calls of any number of rows (the others are built for one).
ANY_ROWS = ("float32", "float16 fbgemm", "q4_1 orcapod", "q4_1_i16 orcapod")


def hold_to_avx2(module: str) -> None:
    """Unless this process runs under ``AVX2_ENV`` already, replace it by ``python -m
    module`` with the same arguments under it (the libraries read it when imported)."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        rerun(module, AVX2_ENV)


class Q4Matrix:
    """Random ``[out, in]`` weights on the Q4_1 grid: ``levels * scale + minimum``."""

    def __init__(self, out_features: int, in_features: int, seed: int) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        groups = in_features // GROUP
        self.levels = torch.randint(0, 16, (out_features, groups, GROUP), generator=generator)
        self.levels[..., :2] = torch.tensor([0, 15])  # as a quantizer makes them: 0..15
        # fp16 scales and minimums, as llama.cpp keeps them.
        scale = torch.rand(out_features, groups, generator=generator) * 0.01 + 1e-4
        self.scale = scale.half().float()
        noise = torch.randn(out_features, groups, generator=generator) * 1e-3
        self.minimum = (-7.5 * self.scale + noise).half().float()
        self.weight = (self.levels * self.scale[..., None] + self.minimum[..., None]).reshape(
            out_features, in_features
        )

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])


def torch_kernels(matrix: Q4Matrix) -> dict[str, tuple[Kernel, int]]:
    """orcapod's own forms: each a callable on ``x`` [1, in] fp32, and its bytes."""
    import torch
    import torch.nn.functional as F

    from gpu_worker.q4_1_kernel import Q41Matrix, kernel_unavailable_reason
    from gpu_worker.quantized_linear import Float16Linear, Int4Kernel, PackError

    weight = matrix.weight.contiguous()
    fp16 = Float16Linear.pack(weight)
    plain = fp16.weight
    assert plain is not None
    loop = torch.compile(lambda x: (plain.float() * x[:, None, :]).sum(-1), dynamic=False)
    kernels: dict[str, tuple[Kernel, int]] = {
        "float32": (lambda x: F.linear(x, weight), weight.nbytes),
        "float16 fbgemm": (fp16, 2 * weight.numel()),
        "float16 loop": (loop, plain.nbytes),
    }
    try:
        int4 = Int4Kernel.pack(weight)
        kernels["int4 torch"] = (lambda x: int4(x).float(), int4.num_bytes)
    except (PackError, RuntimeError) as error:
        log(f"int4 torch: {error}")
    reason = kernel_unavailable_reason()
    if reason is None:
        q4_1 = Q41Matrix.pack(weight)
        kernels["q4_1 orcapod"] = (q4_1, q4_1.num_bytes)
        kernels["q4_1_i16 orcapod"] = (q4_1.with_16_bit_activations, q4_1.num_bytes)
    else:
        log(f"q4_1 orcapod: {reason}")
    return kernels


def onnxruntime_kernels(matrix: Q4Matrix, threads: int) -> dict[str, tuple[Kernel, int]]:
    """``MatMulNBits`` twice: 4-bit integer zero points (the minimum rounded to a
    level) and float zero points (Q4_1's minimum as it is)."""
    import numpy as np
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    def nibbles(values: Any) -> Any:
        """ONNX's 4-bit order: value 2k in the low nibble of byte k, 2k+1 in the high."""
        if values.shape[-1] % 2:
            values = np.concatenate([values, np.zeros_like(values[..., :1])], axis=-1)
        return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)

    out_features, in_features = matrix.shape
    packed = nibbles(matrix.levels.numpy().astype(np.uint8))  # [out, groups, 16]
    scale = matrix.scale.numpy().astype(np.float32)
    zero = (-matrix.minimum.numpy() / scale).astype(np.float32)  # w = (level - zero) * scale
    whole_zero_packed = nibbles(np.clip(np.rint(zero), 0, 15).astype(np.uint8))

    def session(zero_points: Any) -> Kernel:
        initializers = [
            numpy_helper.from_array(packed, "B"),
            numpy_helper.from_array(scale.reshape(-1), "S"),
            numpy_helper.from_array(zero_points.reshape(-1), "Z"),
        ]
        node = helper.make_node(
            "MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft",
            K=in_features, N=out_features, bits=4, block_size=GROUP, accuracy_level=4,
        )  # fmt: skip
        graph = helper.make_graph(
            [node], "matmul",
            [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, in_features])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, out_features])],
            initializers,
        )  # fmt: skip
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        ready = onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return lambda x: ready.run(None, {"A": x.numpy()})[0]

    bytes_4bit = packed.nbytes + scale.nbytes
    return {
        "onnxruntime 4-bit (native)": (
            session(whole_zero_packed),
            bytes_4bit + whole_zero_packed.nbytes,
        ),
        "onnxruntime float zero (native)": (session(zero), bytes_4bit + zero.nbytes),
    }


def numba_kernel(matrix: Q4Matrix, threads: int) -> dict[str, tuple[Kernel, int]]:
    import numpy as np

    from bench.cpu_kernels_numba import Q4RowsAsLanes

    levels = matrix.levels.numpy().astype(np.uint8)
    kernel = Q4RowsAsLanes(levels, matrix.scale.numpy(), matrix.minimum.numpy(), threads)
    return {"numba": (lambda x: kernel(x.numpy()[0]), kernel.num_bytes)}


def measure(threads: int, calls: int, row_counts: list[int]) -> dict[str, Any]:
    import numpy as np
    import torch

    from bench.timing import median_s

    torch.set_num_threads(threads)
    results: dict[str, dict[str, Any]] = {}
    for index, (name, (out_features, in_features)) in enumerate(SHAPES.items()):
        matrix = Q4Matrix(out_features, in_features, seed=index)
        kernels = torch_kernels(matrix)
        if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx"):
            kernels |= onnxruntime_kernels(matrix, threads)
        if importlib.util.find_spec("numba"):
            kernels |= numba_kernel(matrix, threads)
        for rows in row_counts:
            x = torch.randn(rows, in_features)
            reference = x.double() @ matrix.weight.double().T
            for kind, (kernel, num_bytes) in kernels.items():
                if rows > 1 and kind not in ANY_ROWS:
                    continue
                out = torch.as_tensor(np.asarray(kernel(x)), dtype=torch.float64)
                error = float((out.reshape(reference.shape) - reference).abs().max())
                error /= float(reference.abs().max())
                seconds_per_call = median_s(functools.partial(kernel, x), calls)
                label = kind if rows == 1 else f"{kind}, {rows} rows"
                results.setdefault(label, {})[name] = {
                    "us": seconds_per_call * 1e6,
                    "gb_per_s": num_bytes / seconds_per_call / 1e9,
                    "relative_error": error,
                }
                log(f"{label:32s} {name:8s} {seconds_per_call * 1e6:8.1f} us")
    for per_shape in results.values():
        if len(per_shape) == len(SHAPES):
            per_shape["30 layers ms"] = LAYERS * sum(e["us"] for e in per_shape.values()) / 1e3
    return results


def print_table(results: dict[str, Any]) -> None:
    names = list(SHAPES)
    columns = " | ".join(f"{n} µs (GB/s)" for n in names)
    print(f"\n| kernel | {columns} | 30 layers ms | max error |")
    print("|---|" + "---:|" * (len(names) + 2))
    for kind, per_shape in results.items():
        cells = [
            f"{per_shape[n]['us']:.1f} ({per_shape[n]['gb_per_s']:.1f})" if n in per_shape else "-"
            for n in names
        ]
        total = per_shape.get("30 layers ms")
        error = max(per_shape[n]["relative_error"] for n in names if n in per_shape)
        print(f"| {kind} | " + " | ".join(cells) + f" | {total:.2f} | {error:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500, help="timed calls per kernel and shape")
    parser.add_argument("--emulate-avx2", action="store_true")
    parser.add_argument("--rows", default="1", help="row counts of x, e.g. 1,4,16,64,512")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "cpu_kernels.json")
    args = parser.parse_args()
    # Every library is imported below this, so a rerun's imports see AVX2_ENV.
    if args.emulate_avx2:
        hold_to_avx2("bench.cpu_kernels")
    from bench.machine import lscpu_machine

    row_counts = [int(rows) for rows in args.rows.split(",")]
    results = measure(args.threads, args.calls, row_counts)
    print_table(results)
    report = {
        "machine": lscpu_machine(with_torch=True),
        "threads": args.threads,
        "emulated_avx2": args.emulate_avx2,
        "rows": row_counts,
        "kernels": results,
    }
    write_json(args.out, report)
    log(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
