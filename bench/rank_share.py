"""What one rank of a worker group costs to start: each rank's share of the model
loaded alone (``weight_share.py``), in a fresh process, against the whole model.

    python -m bench.rank_share [--model DIR] [--stages 2] [--tensor-parallel 1]
                               [--weights auto] [--out bench/results/rank_share.json]

For the whole model and for each rank of a ``--stages`` × ``--tensor-parallel``
group: the seconds ``load_model`` takes (read, cut, pack, probe) and the
process's peak resident memory after it, each in a child process of its own
(the interpreter and torch included, as a rank pays them), and the bytes of
the weights it holds. Prints the table, writes JSON. Never run by the tests.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time
from pathlib import Path
from typing import Any

import torch

from bench.machine import lscpu_machine, today
from bench.output import RESULTS_DIR, log, write_json
from gpu_worker.model_config import load_model_config
from gpu_worker.model_loading import load_model
from gpu_worker.quantized_linear import weight_format_of
from gpu_worker.weight_share import WeightShare
from gpu_worker.weights import weights_num_bytes
from gpu_worker.worker_group import rank_share
from shared.settings import RedisSettings, WorkerSettings, model_location


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: the prepared SmolLM2)")
    parser.add_argument("--stages", type=int, default=2, help="the group's --pipeline-parallel")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--weights", default="auto", help="the worker's --weights")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "rank_share.json")
    return parser


def _load(model_dir: Path, weights: str, share: WeightShare | None, out: Any) -> None:
    """A child: load, then report seconds, peak memory and held bytes."""
    torch.set_num_threads(1)
    began = time.perf_counter()
    model = load_model(model_dir, "cpu", "float32", weights, share)
    seconds = time.perf_counter() - began
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    held_mib = weights_num_bytes(model.weights) / 2**20
    out.put((seconds, peak_mib, held_mib, weight_format_of(model.weights)))


def _measure(model_dir: Path, weights: str, share: WeightShare | None) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_load, args=(model_dir, weights, share, out))
    child.start()
    seconds, peak_mib, held_mib, weight_format = out.get(timeout=600)
    child.join()
    return {
        "load_s": round(seconds, 2), "peak_rss_mib": round(peak_mib),
        "weights_mib": round(held_mib, 1), "weight_format": weight_format,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    location = model_location(model_dir=args.model)
    model_dir = location.model_dir
    settings = WorkerSettings(
        redis=RedisSettings(url="redis://127.0.0.1:1"), model=location, worker_id="bench",
        pipeline_parallel=args.stages, tensor_parallel=args.tensor_parallel,
    )  # fmt: skip
    config = load_model_config(model_dir)
    rows: dict[str, dict[str, Any]] = {"whole model": _measure(model_dir, args.weights, None)}
    for rank in range(args.stages * args.tensor_parallel):
        share = rank_share(config, settings, rank)
        parts = [f"layers {share.layers.start}-{share.layers.stop - 1}"]
        parts += ["embeddings"] * share.embeddings + ["norm and head"] * share.head
        name = f"rank {rank} ({', '.join(parts)})"
        log(f"{name} ...")
        rows[name] = _measure(model_dir, args.weights, share)
    print("| what is loaded | load s | peak RSS MiB | weights MiB | format |")
    print("|---|---:|---:|---:|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['load_s']} | {row['peak_rss_mib']} | {row['weights_mib']} "
            f"| {row['weight_format']} |"
        )
    document = {
        "machine": lscpu_machine(with_torch=True), "date": today(),
        "settings": vars(args) | {"model": str(model_dir), "out": str(args.out)}, "rows": rows,
    }  # fmt: skip
    write_json(args.out, document)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
