"""The LM head of a decode step in each form the worker can keep it, side by side.

    python -m bench.lm_head [--model DIR] [--rows 1,4,16,64] [--threads 2]
                            [--copies 8] [--calls 100] [--emulate-avx2]
                            [--out bench/results/lm_head.json]

The packaged SmolLM2's head is its tied embedding [49152, 576] on llama.cpp's
Q8_0 grid (30 MB as int8, 57 MB as fp16). A step reads the whole head for every
row it samples, after the layers have pushed it out of the caches; so each form
is timed on ``--copies`` copies of the head taken in turn (8 x 30 MB is beyond
any L3 here), each call reading its weights from memory, as in a step:

- ``float16 fbgemm``: fbgemm's fp16 kernel, the head the float16 format keeps
  (and the q4_1 format's before the kernel took Q8_0);
- ``q8_0 orcapod``: the project's kernel's Q8_0 form (``csrc/q4_1_linear.cpp``,
  AVX2 code on every CPU): exact;
- ``q8_0 int16``: the same matrix times the activations rounded to int16 per 32
  values (``q8_0_i16_linear``), the head of ``q4_1_i16``;
- ``int8 inductor``: the int8 form compiled graphs read on AVX-512 CPUs
  (``Int8GroupLinear`` inside ``torch.compile``), one row only (the lone graph).

The forms take turns call by call (``interleaved_median_s``). Prints the median
ms a call, GB/s of the form's bytes and the largest error against the fp32
product (relative to the largest logit); writes JSON. ``--emulate-avx2`` reruns
it with torch, inductor and fbgemm held to AVX2 (``bench.cpu_kernels``'s
environment). Never run by the test suite.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

from bench.cpu_kernels import hold_to_avx2
from bench.output import RESULTS_DIR, log, write_json


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: the prepared SmolLM2)")
    parser.add_argument("--rows", default="1,4,16,64", help="logits rows a step samples")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=8, help="copies of the head taken in turn")
    parser.add_argument("--calls", type=int, default=100, help="timed calls per form and rows")
    parser.add_argument("--emulate-avx2", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "lm_head.json")
    return parser


def _forms(head: Any, copies: int) -> dict[str, tuple[list[Any], int, bool]]:
    """Each form's ``copies`` callables, its bytes, and whether it takes any number of rows."""
    import torch

    from gpu_worker.q4_1_kernel import Q80Matrix, kernel_unavailable_reason
    from gpu_worker.quantized_linear import Float16Linear, Int8GroupLinear

    forms: dict[str, tuple[list[Any], int, bool]] = {}
    fp16 = [Float16Linear.pack_head(head) for _ in range(copies)]
    forms["float16 fbgemm"] = (fp16, 2 * head.numel(), True)
    if kernel_unavailable_reason() is None:
        q8_0 = [Q80Matrix.pack(head) for _ in range(copies)]
        forms["q8_0 orcapod"] = (q8_0, q8_0[0].num_bytes, True)
        int16 = [matrix.with_16_bit_activations for matrix in q8_0]
        forms["q8_0 int16"] = (int16, q8_0[0].num_bytes, True)
    int8 = [Int8GroupLinear.pack(head) for _ in range(copies)]
    out_features, in_features = head.shape

    def int8_head(words: Any, scales: Any, x: Any) -> Any:
        return Int8GroupLinear(words, scales, out_features, in_features)(x)

    # One graph for every copy: the weights are its inputs, as a step's are.
    graph = torch.compile(int8_head, fullgraph=True, dynamic=False)
    compiled = [functools.partial(graph, matrix.words, matrix.scales) for matrix in int8]
    forms["int8 inductor"] = (compiled, int8[0].num_bytes, False)
    return forms


def measure(head: Any, rows_list: list[int], copies: int, calls: int) -> list[dict[str, Any]]:
    import itertools

    import torch

    from bench.timing import interleaved_median_s

    forms = _forms(head, copies)
    table = []
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, head.shape[1])
            reference = x.double() @ head.double().T
            runs, names = [], []
            for name, (callables, num_bytes, any_rows) in forms.items():
                if rows > 1 and not any_rows:
                    continue
                error = float((callables[0](x).double() - reference).abs().max())
                turn = itertools.cycle(callables)
                runs.append((lambda turn=turn, x=x: next(turn)(x), lambda: None))
                names.append((name, num_bytes, error / float(reference.abs().max())))
            for (name, num_bytes, error), seconds in zip(
                names, interleaved_median_s(runs, calls), strict=True
            ):
                table.append({
                    "form": name, "rows": rows, "ms": seconds * 1e3, "mb": num_bytes / 1e6,
                    "gb_per_s": num_bytes / seconds / 1e9, "relative_error": error,
                })  # fmt: skip
                log(f"{name:16s} {rows:3d} rows {seconds * 1e3:7.2f} ms")
    return table


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    # Every library is imported below this, so a rerun's imports see the AVX2 environment.
    if args.emulate_avx2:
        hold_to_avx2("bench.lm_head")
    import torch

    from bench.machine import lscpu_machine, today
    from gpu_worker.model_config import load_model_config
    from gpu_worker.weights import load_weights
    from shared.settings import model_location

    torch.set_num_threads(args.threads)
    model_dir = Path(model_location(model_dir=args.model).model_dir)
    config = load_model_config(model_dir)
    head = load_weights(model_dir, config, torch.device("cpu"), torch.float32).lm_head
    assert isinstance(head, torch.Tensor)
    rows_list = [int(rows) for rows in args.rows.split(",")]
    table = measure(head, rows_list, args.copies, args.calls)
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"\nLM head {list(head.shape)}, {args.threads} threads, {args.copies} copies in turn, "
          f"torch's vector code {capability}")  # fmt: skip
    print("| form | rows | ms a call | MB | GB/s | max error |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in table:
        print(f"| {row['form']} | {row['rows']} | {row['ms']:.2f} | {row['mb']:.1f} | "
              f"{row['gb_per_s']:.1f} | {row['relative_error']:.1e} |")  # fmt: skip
    document = {"machine": lscpu_machine(with_torch=True), "date": today(),
                "emulated_avx2": args.emulate_avx2, "threads": args.threads,
                "copies": args.copies, "rows": table}  # fmt: skip
    write_json(args.out, document)
    log(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
