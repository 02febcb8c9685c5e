"""GPU engine numbers: the device's ceilings, then decode step time against them.

    python -m bench.gpu [--out bench/results/gpu.json] [--table-out FILE] [--quick]

Run by ``bench/gpu.sh`` (which adds ``orcapod bench`` end to end). Measures:

1. ceilings: device-to-device copy bandwidth (bytes read + written per second)
   and the bf16 matmul rate (8192^3);
2. a correctness check of the ``triton`` backend against ``reference`` on this
   GPU (fp32 and bf16, mixed prompt chunks and decodes);
3. decode step time for batch 1..256 and context 256..4096, for a 1B-class
   Llama config (Llama 3.2 1B's shape) and SmolLM2-135M's shape, both with
   random bf16 weights: eager (prepare + forward, the ``triton`` backend) and
   CUDA-graph replay (``DecodeGraphRunner.run``: padding, input copies,
   replay). Each request attends exactly ``context`` keys through a shuffled
   block table. The bandwidth floor of a step is (weights + K/V read once) /
   copy bandwidth; achieved bandwidth is those bytes / step time;
4. the CPU cost of launching a graph step (host time of ``run`` on an idle GPU,
   less the padding of its inputs, which is reported on its own);
5. the Triton pointwise kernels against the torch ops over a whole forward.

Timings are medians of ``--steps`` after warm-up, each step synchronised.
Sampling and plan checks are not included (they are the same on every device).
Prints the table last and the targets (PASS/MISS). Exits 0 with a message on
a machine without CUDA.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.machine import today
from bench.output import RESULTS_DIR, write_json
from bench.timing import median_s
from gpu_worker.attention import AttentionBackend, SequenceLayout, make_backend
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.llama import LlamaModel
from gpu_worker.model_config import ModelConfig, RopeScaling
from gpu_worker.pointwise import make_pointwise
from gpu_worker.weights import random_weights, weights_num_bytes

BLOCK_SIZE = 16
TARGET_BATCH, TARGET_CONTEXT, TARGET_FLOOR_RATIO = 64, 1024, 1.5
TARGET_LAUNCH_US = 50.0
# Replay runs the same kernels on a padded batch: only bf16 rounding may differ.
GRAPH_TOLERANCE = 2e-2
Row = dict[str, Any]


def llama_config(name: str) -> ModelConfig:
    """Llama 3.2 1B's shape ('llama-1b') or SmolLM2-135M's ('smollm2-135m')."""
    shapes: dict[str, dict[str, Any]] = {
        "llama-1b": dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
            num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        ),
        "smollm2-135m": dict(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        ),
    }  # fmt: skip
    return ModelConfig(
        **shapes[name],
        rms_norm_eps=1e-5,
        rope_scaling=RopeScaling(),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        eos_token_ids=(2,),
    )


def gpu_median_s(run: Callable[[], object], steps: int, warmup: int = 2) -> float:
    """Median wall seconds of ``run`` with the GPU synchronised around each call."""

    def synchronized() -> None:
        run()
        torch.cuda.synchronize()

    return median_s(synchronized, steps, warmups=warmup)


def ceilings(quick: bool) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s)."""
    num_bytes = (256 if quick else 1024) << 20
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    copy_s = gpu_median_s(lambda: target.copy_(source), 10)
    size = 4096 if quick else 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    matmul_s = gpu_median_s(lambda: a @ b, 10)
    return {
        "copy_bandwidth_gb_s": 2 * num_bytes / copy_s / 1e9,
        "bf16_matmul_tflop_s": 2 * size**3 / matmul_s / 1e12,
    }


def check_triton(device: torch.device) -> list[Row]:
    """Max relative error of the triton backend against reference on this GPU."""
    rng = random.Random(0)
    shapes = [(37, 0), (5, 40), (1, 15), (1, 16), (1, 17), (1, 300), (64, 129), (1, 0)]
    free_blocks = list(range(256))
    rng.shuffle(free_blocks)
    layout, start = [], 0
    for num_query, num_cached in shapes:
        table = [free_blocks.pop() for _ in range(-(-(num_query + num_cached) // BLOCK_SIZE))]
        layout.append(SequenceLayout(start, num_query, num_cached, table))
        start += num_query
    results = []
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        generator = torch.Generator(device=device).manual_seed(0)
        normal = partial(random_tensor, generator=generator, dtype=dtype)

        queries = normal((start, 32, 64))
        keys, values = normal((256 * BLOCK_SIZE, 8, 64)), normal((256 * BLOCK_SIZE, 8, 64))
        reference = make_backend("reference", torch.float32)
        expected = reference.attend(
            queries.float(), keys.float(), values.float(),
            reference.prepare(layout, BLOCK_SIZE, device),
        )  # fmt: skip
        triton_backend = make_backend("triton", dtype)
        got = triton_backend.attend(
            queries, keys, values, triton_backend.prepare(layout, BLOCK_SIZE, device)
        )
        error = float((got.float() - expected).abs().max() / expected.abs().max())
        results.append(
            {"dtype": str(dtype).removeprefix("torch."), "max_relative_error": error,
             "tolerance": tolerance, "ok": error < tolerance and not got.isnan().any().item()}
        )  # fmt: skip
    return results


def check_pointwise(device: torch.device) -> list[Row]:
    """Logits of one mixed step (a 37-token prompt chunk and 7 decodes, SmolLM2's shape,
    random weights) with the Triton pointwise kernels and with the torch ops.

    fp32: the two against each other. bf16: each against the fp32 torch logits, since
    bf16 alone is that far from fp32 (about 5e-2 with these random weights); the
    kernels pass when their error is within 1.5 times the torch ops' own."""
    config = llama_config("smollm2-135m")
    rng = random.Random(1)
    shapes = [(37, 0), *((1, rng.randrange(1, 300)) for _ in range(7))]
    num_blocks = sum(-(-(q + c) // BLOCK_SIZE) for q, c in shapes)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    layout, positions, slots, start = [], [], [], 0
    for num_query, num_cached in shapes:
        table = [blocks.pop() for _ in range(-(-(num_query + num_cached) // BLOCK_SIZE))]
        layout.append(SequenceLayout(start, num_query, num_cached, table))
        for position in range(num_cached, num_cached + num_query):
            positions.append(position)
            slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        start += num_query
    token_ids = [rng.randrange(config.vocab_size) for _ in range(start)]
    logits_rows = [sequence.query_start + sequence.num_query_tokens - 1 for sequence in layout]

    def logits(dtype: torch.dtype, pointwise: str) -> torch.Tensor:
        weights = random_weights(config, device, dtype)
        model = LlamaModel(config, weights, device, dtype, make_pointwise(pointwise))
        cache = PagedKVCache(config, num_blocks, BLOCK_SIZE, device, dtype)
        backend = make_backend("triton", dtype)
        return model.forward(
            token_ids=torch.tensor(token_ids, device=device),
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(slots, device=device),
            kv_cache=cache,
            backend=backend,
            attention_plan=backend.prepare(layout, BLOCK_SIZE, device),
            logits_rows=torch.tensor(logits_rows, device=device),
        )

    def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
        return float((got - expected).abs().max() / expected.abs().max())

    reference = logits(torch.float32, "torch")
    fp32_error = relative_error(logits(torch.float32, "triton"), reference)
    torch_bf16 = relative_error(logits(torch.bfloat16, "torch"), reference)
    triton_bf16 = logits(torch.bfloat16, "triton")
    bf16_error = relative_error(triton_bf16, reference)
    return [
        {"dtype": "float32", "against": "torch ops, fp32", "max_relative_error": fp32_error,
         "tolerance": 1e-4, "ok": fp32_error < 1e-4},
        {"dtype": "bfloat16", "against": "torch ops, fp32", "max_relative_error": bf16_error,
         "torch_ops_error": torch_bf16, "tolerance": 1.5 * torch_bf16,
         "ok": bf16_error <= 1.5 * torch_bf16 and not triton_bf16.isnan().any().item()},
    ]  # fmt: skip


def check_engine(device: torch.device) -> Row:
    """Greedy tokens of staggered, chunked requests through the whole engine on the GPU:
    Triton kernels and CUDA graphs against the reference attention and torch ops (fp32,
    SmolLM2's shape, random weights). Mixed steps run eagerly, decode-only steps replay."""
    from gpu_worker.engine import Engine
    from gpu_worker.kv_cache import KVCacheBudget
    from tests.gpu_worker.plans import random_jobs, run_jobs

    config = llama_config("smollm2-135m")
    weights = random_weights(config, device, torch.float32)
    generated, num_steps, used_graphs = {}, 0, False
    for name in ("reference", "triton"):
        pointwise = make_pointwise("torch" if name == "reference" else "triton")
        model = LlamaModel(config, weights, device, torch.float32, pointwise)
        budget = KVCacheBudget(num_bytes=256 << 20, block_size=BLOCK_SIZE)
        engine = Engine(model, budget, name, use_cuda_graphs=name == "triton")
        jobs = random_jobs(3, 12, 40000, 60, (8, 40), 12, (7, 16, 1000))
        outputs = run_jobs(engine, jobs)
        generated[name] = [job.generated_ids for job in jobs]
        if name == "triton":
            num_steps, used_graphs = len(outputs), engine.uses_cuda_graphs
    same = generated["triton"] == generated["reference"]
    num_tokens = sum(len(ids) for ids in generated["reference"])
    return {"num_tokens": num_tokens, "num_steps": num_steps, "cuda_graphs": used_graphs,
            "same_tokens": same, "ok": same and used_graphs}  # fmt: skip


def random_tensor(
    shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    """Standard normal values on the generator's device, rounded to ``dtype``."""
    return torch.randn(shape, generator=generator, device=generator.device).to(dtype)


def decode_layout(
    batch: int, context: int, rng: random.Random, num_blocks: int
) -> tuple[list[SequenceLayout], list[int], list[int]]:
    """``batch`` decodes at position ``context - 1`` on shuffled blocks.

    Returns the layout, each token's position and each token's K/V slot.
    """
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    blocks_per_request = -(-context // BLOCK_SIZE)
    layout, slots = [], []
    for row in range(batch):
        table = blocks[row * blocks_per_request : (row + 1) * blocks_per_request]
        layout.append(SequenceLayout(row, 1, context - 1, table))
        last = context - 1
        slots.append(table[last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE)
    return layout, [context - 1] * batch, slots


def eager_step(
    model: LlamaModel,
    cache: PagedKVCache,
    backend: AttentionBackend,
    layout: list[SequenceLayout],
    token_ids: list[int],
    positions: list[int],
    slots: list[int],
) -> torch.Tensor:
    """One decode step without graphs: host lists to device, prepare, forward."""
    device = model.device
    return model.forward(
        token_ids=torch.tensor(token_ids, device=device),
        positions=torch.tensor(positions, device=device),
        slot_mapping=torch.tensor(slots, device=device),
        kv_cache=cache,
        backend=backend,
        attention_plan=backend.prepare(layout, cache.block_size, device),
        logits_rows=torch.arange(len(layout), device=device),
    )


def measure_config(
    name: str, batches: list[int], contexts: list[int], steps: int, bandwidth_gb_s: float
) -> tuple[list[Row], list[float], list[float]]:
    """Decode rows (eager and graph) for one config, the graph launch and the input
    padding times (µs)."""
    from gpu_worker.cuda_graphs import DecodeGraphRunner, pad_decode_step

    device, dtype = torch.device("cuda"), torch.bfloat16
    config = llama_config(name)
    weights = random_weights(config, device, dtype)
    model = LlamaModel(config, weights, device, dtype)
    num_blocks = max(batches) * -(-max(contexts) // BLOCK_SIZE)
    cache = PagedKVCache(config, num_blocks, BLOCK_SIZE, device, dtype)
    for layer_keys, layer_values in zip(cache.keys, cache.values, strict=True):
        layer_keys.normal_()
        layer_values.normal_()
    backend = make_backend("triton", dtype)
    started = time.perf_counter()
    runner = DecodeGraphRunner(model, cache, backend)
    capture_s = time.perf_counter() - started
    print(f"{name}: captured {len(runner.buckets)} decode graphs in {capture_s:.1f} s", flush=True)
    weights_bytes = weights_num_bytes(weights, embeddings=False)
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    rng = random.Random(0)
    rows, launch_us, prepare_us = [], [], []
    for context in contexts:
        for batch in batches:
            layout, positions, slots = decode_layout(batch, context, rng, num_blocks)
            token_ids = [rng.randrange(config.vocab_size) for _ in range(batch)]

            eager = partial(eager_step, model, cache, backend, layout, token_ids, positions, slots)
            graph = partial(runner.run, token_ids, positions, slots, layout)
            eager_logits, graph_logits = eager().float(), graph().float()
            graph_error = float(
                (graph_logits - eager_logits).abs().max() / eager_logits.abs().max()
            )
            step_bytes = weights_bytes + batch * context * kv_bytes_per_token
            floor_s = step_bytes / (bandwidth_gb_s * 1e9)
            for impl, run in (("eager", eager), ("cuda graph", graph)):
                step_s = gpu_median_s(run, steps)
                rows.append(
                    {"model": name, "impl": impl, "batch": batch, "context": context,
                     "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
                     "bytes_read": step_bytes, "achieved_gb_s": step_bytes / step_s / 1e9,
                     "floor_ms": floor_s * 1e3, "floor_ratio": step_s / floor_s,
                     "graph_vs_eager_error": graph_error}
                )  # fmt: skip
            # CPU time of a graph step on an idle GPU: padding the inputs (Python lists to
            # arrays), then the rest of `run` (staging, copies, replay), the launch.
            for _ in range(5):
                torch.cuda.synchronize()
                started = time.perf_counter()
                pad_decode_step(token_ids, positions, slots, layout)
                pad_s = time.perf_counter() - started
                started = time.perf_counter()
                graph()
                run_s = time.perf_counter() - started
                prepare_us.append(pad_s * 1e6)
                launch_us.append((run_s - pad_s) * 1e6)
            torch.cuda.synchronize()
            print(f"  {name} context {context} batch {batch}: "
                  f"eager {rows[-2]['step_ms']:.2f} ms, graph {rows[-1]['step_ms']:.2f} ms, "
                  f"floor {floor_s * 1e3:.2f} ms", flush=True)  # fmt: skip
    return rows, launch_us, prepare_us


def prefill_rows(steps: int) -> list[Row]:
    """One forward of 8 fresh prompts of 512 tokens (the kernel's prefill tiles);
    the plan is prepared once, outside the timing."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for name in ("llama-1b", "smollm2-135m"):
        config = llama_config(name)
        model = LlamaModel(config, random_weights(config, device, dtype), device, dtype)
        cache = PagedKVCache(config, 8 * 512 // BLOCK_SIZE, BLOCK_SIZE, device, dtype)
        backend = make_backend("triton", dtype)
        per_request = 512 // BLOCK_SIZE
        layout = [
            SequenceLayout(i * 512, 512, 0, list(range(i * per_request, (i + 1) * per_request)))
            for i in range(8)
        ]
        num_tokens = 8 * 512
        token_ids = torch.randint(config.vocab_size, (num_tokens,), device=device)
        positions = torch.arange(512, device=device).repeat(8)
        slots = torch.arange(num_tokens, device=device)
        logits_rows = torch.arange(511, num_tokens, 512, device=device)
        plan = backend.prepare(layout, BLOCK_SIZE, device)
        run = partial(model.forward, token_ids, positions, slots, cache, backend, plan, logits_rows)
        step_s = gpu_median_s(run, steps)
        rows.append(
            {"model": name, "impl": "forward, prefill 8 x 512", "batch": 8, "context": 512,
             "step_ms": step_s * 1e3, "tokens_per_s": num_tokens / step_s}
        )  # fmt: skip
    return rows


def pointwise_lines(checks: list[Row]) -> list[str]:
    """One line per ``check_pointwise`` row."""
    lines = []
    for check in checks:
        torch_error = check.get("torch_ops_error")
        also = "" if torch_error is None else f"; torch ops' own: {torch_error:.1e}"
        lines.append(
            f"triton pointwise kernels, whole forward ({check['dtype']}) vs "
            f"{check['against']}: max relative error {check['max_relative_error']:.1e} "
            f"(tolerance {check['tolerance']:.1e}{also}) {'OK' if check['ok'] else 'FAIL'}"
        )
    return lines


def table(result: dict[str, Any]) -> str:
    """The Markdown table printed last (and written with ``--table-out``)."""
    ceiling = result["ceilings"]
    lines = [
        f"GPU: {result['device']} | copy {ceiling['copy_bandwidth_gb_s']:.0f} GB/s | "
        f"bf16 matmul {ceiling['bf16_matmul_tflop_s']:.0f} TFLOP/s",
        "",
        "| model | impl | batch | context | step ms | tokens/s | floor ms | × floor | GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        floor = f"{row['floor_ms']:.2f}" if "floor_ms" in row else ""
        ratio = f"{row['floor_ratio']:.2f}" if "floor_ratio" in row else ""
        achieved = f"{row['achieved_gb_s']:.0f}" if "achieved_gb_s" in row else ""
        lines.append(
            f"| {row['model']} | {row['impl']} | {row['batch']} | {row['context']} | "
            f"{row['step_ms']:.2f} | {row['tokens_per_s']:,.0f} | {floor} | {ratio} | {achieved} |"
        )
    lines.append("")
    graph_errors = [row["graph_vs_eager_error"] for row in result["rows"] if "floor_ms" in row]
    if graph_errors:
        worst = max(graph_errors)
        lines.append(
            f"cuda graph vs eager logits: max relative error {worst:.1e} "
            f"(tolerance {GRAPH_TOLERANCE:.0e}) {'OK' if worst < GRAPH_TOLERANCE else 'FAIL'}"
        )
    for check in result["triton_check"]:
        lines.append(
            f"triton vs reference ({check['dtype']}): max relative error "
            f"{check['max_relative_error']:.1e} (tolerance {check['tolerance']:.0e}) "
            f"{'OK' if check['ok'] else 'FAIL'}"
        )
    lines += pointwise_lines(result["pointwise_check"])
    engine = result["engine_check"]
    lines.append(
        f"engine, triton kernels and CUDA graphs vs reference attention and torch ops, greedy "
        f"(fp32): {engine['num_tokens']} tokens, same: {engine['same_tokens']}, graphs used: "
        f"{engine['cuda_graphs']} {'OK' if engine['ok'] else 'FAIL'}"
    )
    padding = result["graph_input_padding_us"]
    lines.append(
        f"graph step input padding (not in the launch): median {statistics.median(padding):.0f}"
        f" µs, max {max(padding):.0f} µs"
    )
    for target in result["targets"]:
        lines.append(f"{'PASS' if target['pass'] else 'MISS'}  {target['what']}: {target['value']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu.json")
    parser.add_argument("--table-out", default=None, help="also write the table here")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="fewer points (a smoke run)")
    parser.add_argument(
        "--checks-only", action="store_true", help="only the correctness checks, no timings"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: GPU numbers not measured")
        return 0
    import triton

    device = torch.device("cuda")
    torch.manual_seed(0)
    if args.checks_only:
        checks = check_triton(device)
        for check in checks:
            print(f"triton vs reference ({check['dtype']}): {check}")
        pointwise = check_pointwise(device)
        print("\n".join(pointwise_lines(pointwise)))
        engine = check_engine(device)
        print(f"engine, triton kernels and CUDA graphs vs reference, greedy tokens: {engine}")
        return 0 if all(c["ok"] for c in [*checks, *pointwise, engine]) else 1
    batches = [1, 8, 64] if args.quick else [1, 4, 16, 64, 128, 256]
    contexts = [256, 1024] if args.quick else [256, 1024, 4096]
    ceiling = ceilings(args.quick)
    print(f"ceilings: {ceiling}", flush=True)
    checks = check_triton(device)
    pointwise_checks = check_pointwise(device)
    engine_check = check_engine(device)
    print(f"engine check: {engine_check}", flush=True)
    rows, launch_us, prepare_us = [], [], []
    for name in ("llama-1b", "smollm2-135m"):
        config_rows, config_launch, config_prepare = measure_config(
            name, batches, contexts, args.steps, ceiling["copy_bandwidth_gb_s"]
        )
        rows += config_rows
        launch_us += config_launch
        prepare_us += config_prepare
        torch.cuda.empty_cache()  # the config's weights and pool are garbage now
    rows += prefill_rows(args.steps)
    targets = []
    for impl in ("eager", "cuda graph"):
        hit = [r for r in rows if r["model"] == "llama-1b" and r["impl"] == impl
               and r["batch"] == TARGET_BATCH and r["context"] == TARGET_CONTEXT]  # fmt: skip
        if hit:
            ratio = hit[0]["floor_ratio"]
            targets.append(
                {"what": f"llama-1b decode batch 64 context 1024 ({impl}) within "
                         f"{TARGET_FLOOR_RATIO}x of its bandwidth floor",
                 "value": f"{ratio:.2f}x", "pass": ratio <= TARGET_FLOOR_RATIO}
            )  # fmt: skip
    median_launch = statistics.median(launch_us)
    targets.append(
        {"what": f"CUDA-graph decode step CPU launch overhead under {TARGET_LAUNCH_US:.0f} µs",
         "value": f"median {median_launch:.1f} µs", "pass": median_launch < TARGET_LAUNCH_US}
    )  # fmt: skip
    result = {
        "date": today(),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "block_size": BLOCK_SIZE,
        "steps": args.steps,
        "ceilings": ceiling,
        "triton_check": checks,
        "pointwise_check": pointwise_checks,
        "engine_check": engine_check,
        "graph_launch_us": launch_us,
        "graph_input_padding_us": prepare_us,
        "rows": rows,
        "targets": targets,
    }
    write_json(args.out, result)
    text = table(result)
    if args.table_out:
        Path(args.table_out).write_text(text + "\n")
    print(f"wrote {args.out}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
