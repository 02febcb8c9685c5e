"""The LM head of a tensor-parallel stage: replicated (its leader computes the whole
product, as the worker does) against vocab-parallel (each of T ranks a 1/T slice
of the vocabulary, then the logits gathered where the sampler runs), measured.

    python -m bench.tensor_head [--model DIR] [--ranks 3] [--rows 1,16,64]
                                [--repeats 50] [--out bench/results/tensor_head.json]

For each row count: the whole head's product (the worker's packed form, one
thread, as a rank of a group on this host runs), one rank's slice, and a gloo
``all_gather`` of the slices' logits among ``--ranks`` processes on this host
(medians). Vocab-parallel costs its leader a slice plus the gather (the ranks'
slices run at once where each rank has its own device or cores); replicated
costs the whole head. Prints the table, writes JSON. Never run by the tests.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.machine import lscpu_machine, today
from bench.output import RESULTS_DIR, log, write_json
from bench.timing import median_s
from gpu_worker.model_loading import load_model
from gpu_worker.pipeline_layout import free_local_port
from gpu_worker.quantized_linear import Float16Linear, Q41Linear, weight_format_of
from gpu_worker.weights import load_weights
from shared.settings import model_location


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: the prepared SmolLM2)")
    parser.add_argument("--ranks", type=int, default=3, help="tensor-parallel ranks T")
    parser.add_argument("--rows", default="1,16,64", help="logits rows a step samples")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "tensor_head.json")
    return parser


def _gather_rank(
    rank: int, ranks: int, port: int, shapes: list[tuple[int, int]], repeats: int, results: Any
) -> None:
    """One rank: ``repeats`` all_gathers of a [rows, vocab / T] slice for each shape;
    rank 0 puts each shape's median (s)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, ranks, rank == 0, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)
    medians = {}
    for rows, width in shapes:
        piece = torch.randn(rows, width)
        gathered = [torch.empty_like(piece) for _ in range(ranks)]
        times = []
        for _ in range(repeats):
            dist.barrier()
            began = time.perf_counter()
            dist.all_gather(gathered, piece)
            torch.cat(gathered, dim=-1)
            times.append(time.perf_counter() - began)
        medians[rows] = sorted(times)[len(times) // 2]
    if rank == 0:
        results.put(medians)
    dist.destroy_process_group()


def gather_s(ranks: int, shapes: list[tuple[int, int]], repeats: int) -> dict[int, float]:
    """The median time of gathering each shape's slices among ``ranks`` processes."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_local_port()
    processes = [
        context.Process(target=_gather_rank, args=(rank, ranks, port, shapes, repeats, results))
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    medians: dict[int, float] = results.get(timeout=300)
    for process in processes:
        process.join(timeout=60)
    return medians


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    model_dir = Path(model_location(model_dir=args.model).model_dir)
    rows_list = [int(rows) for rows in args.rows.split(",")]
    torch.set_num_threads(1)
    model = load_model(model_dir, "cpu", "float32", "auto")
    head = model.weights.lm_head
    assert not isinstance(head, torch.Tensor), "the head is packed as the worker packs it"
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    width = -(-vocab // args.ranks)
    # A rank's slice in the form the worker keeps the head in (q4_1's: the kernel's
    # Q8_0 form where the head is on that grid, as the packaged model's is).
    loaded = load_weights(model_dir, model.config, model.device, model.dtype).lm_head
    assert isinstance(loaded, torch.Tensor)
    packer = Q41Linear if weight_format_of(model.weights) == "q4_1" else Float16Linear
    piece = packer.pack_head(loaded[:width].contiguous())
    log(f"gathering [rows, {width}] among {args.ranks} processes ...")
    gathered = gather_s(args.ranks, [(rows, width) for rows in rows_list], args.repeats)
    table = []
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, hidden)
            whole = median_s(lambda x=x: head(x), args.repeats)  # type: ignore[misc]
            one_slice = median_s(lambda x=x: piece(x), args.repeats)  # type: ignore[misc]
            table.append({
                "rows": rows,
                "replicated_ms": whole * 1000,
                "slice_ms": one_slice * 1000,
                "gather_ms": gathered[rows] * 1000,
                "vocab_parallel_ms": (one_slice + gathered[rows]) * 1000,
            })  # fmt: skip
    print(f"\nLM head [{vocab}, {hidden}], T = {args.ranks}, "
          f"weights {weight_format_of(model.weights)}, one thread a rank")  # fmt: skip
    print("| rows | replicated (whole head) ms | vocab-parallel: slice + gather ms | "
          "slice ms | gather ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for row in table:
        print(f"| {row['rows']} | {row['replicated_ms']:.2f} | {row['vocab_parallel_ms']:.2f} | "
              f"{row['slice_ms']:.2f} | {row['gather_ms']:.2f} |")  # fmt: skip
    document = {"machine": lscpu_machine(with_torch=True), "date": today(),
                "ranks": args.ranks, "vocab": vocab, "hidden": hidden, "rows": table}  # fmt: skip
    write_json(args.out, document)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
