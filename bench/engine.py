"""Engine step time on the CPU: our selective-batched engine beside transformers.

    python -m bench.engine [--quick] [--dtype float32,bfloat16] [--backends reference,cpu]
                           [--batches 1,8,32,64] [--context 256] [--model DIR | --config tiny]
                           [--weights F] [--no-compile-decode] [--steps N]

Each step is timed by wall clock around ``Engine.step`` (plan checks, forward,
sampling) or around transformers' forward; both sides compute logits only for
the rows they sample (``logits_to_keep=1``). Per dtype it measures:

1. decode: one step of B requests that each attend exactly ``--context``
   tokens (median of ``--steps``), our ``reference`` and ``cpu`` attention
   backends beside transformers' batched forward on a StaticCache, taking turns
   step by step (this machine's speed drifts within minutes); ours with the
   worker's compiled decodes unless ``--no-compile-decode`` (a lone decode's
   graph, batches' compiled attention);
2. prefill: one request of 512 tokens in one step;
3. mixed: 8 prompts, lengths from U(32, 512) (seed 0), in one step: ours
   flattened with no padding, transformers right-padded to the longest;
4. overhead: batch-1 decode of a 30-layer model with tiny widths, where the
   math is nearly free, so the step time is per-op dispatch cost;
5. the least-squares fit ``step_s = a + b*new_tokens + c*attended_tokens`` over
   our ``cpu`` steps, written as "cost_model" for ``orcapod simulate --engine-json``.

Prints a Markdown table and the targets (PASS/MISS), then writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers

from bench.engine_plans import (
    BLOCK_SIZE,
    decode_plan,
    prefill_in_groups,
    prefill_plan,
    release_plan,
    rewind,
)
from bench.machine import torch_machine
from bench.output import RESULTS_DIR, write_json
from bench.timing import interleaved_median_s, median_s
from gpu_worker.attention import BACKEND_NAMES, AttentionBackend, make_backend
from gpu_worker.block_tables import blocks_for
from gpu_worker.device import DTYPES, choose_dtype, cpu_has_native_bf16
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.llama import LlamaModel
from gpu_worker.local_blocks import grant_free_blocks, step_alone
from gpu_worker.model_config import ModelConfig, RopeScaling
from gpu_worker.model_loading import load_model
from gpu_worker.weights import random_weights
from shared.settings import WEIGHT_FORMATS, model_location

CPU = torch.device("cpu")
OVERHEAD_LAYERS = 30
Row = dict[str, Any]


def tiny_config(num_layers: int, hidden: int, num_heads: int, num_kv_heads: int) -> ModelConfig:
    """A Llama shape small enough that its math costs next to nothing."""
    return ModelConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden // num_heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_bias=False,
        eos_token_ids=(2,),
    )


def random_models(config: ModelConfig, dtype: torch.dtype) -> tuple[LlamaModel, Any]:
    """Ours with random weights and a transformers twin of the same shape."""
    ours = LlamaModel(config, random_weights(config, CPU, dtype), CPU, dtype)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=True,
        )
    )
    return ours, theirs.to(dtype).eval()


def load_models(args: argparse.Namespace, dtype_name: str) -> tuple[LlamaModel, Any]:
    dtype = DTYPES[dtype_name]
    if args.config == "tiny":
        return random_models(tiny_config(4, 64, 4, 2), dtype)
    model_dir = model_location(model_dir=args.model).model_dir
    theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return load_model(model_dir, "cpu", dtype_name, args.weights), theirs.eval()


def use_backend(engine: Engine, backend: AttentionBackend) -> None:
    """The engine's eager steps through ``backend`` (its decodes through the paged
    attention where it has one)."""
    engine.paths.backend = backend
    engine.paths.paged_backend = backend if getattr(backend, "decode_kernel", None) else None


def row(measurement: str, dtype: str, impl: str, batch: int, new: int, attended: int | None,
        step_s: float) -> Row:  # fmt: skip
    return {
        "measurement": measurement, "dtype": dtype, "impl": impl, "batch": batch,
        "new_tokens": new, "attended_tokens": attended,
        "step_ms": step_s * 1000, "tokens_per_s": new / step_s,
    }  # fmt: skip


def prefill_attended(num_tokens: int, num_cached: int = 0) -> int:
    """K/V tokens the queries of a chunk attend: sum over i of (cached + i)."""
    return num_tokens * num_cached + num_tokens * (num_tokens + 1) // 2


def our_prefill_s(engine: Engine, prompts: list[list[int]], repeats: int) -> float:
    request_ids = [f"p{i}" for i in range(len(prompts))]
    plan = prefill_plan(dict(zip(request_ids, prompts, strict=True)))
    release = release_plan(request_ids)
    plan = grant_free_blocks(engine, plan)  # the same blocks again after each release
    seconds = median_s(partial(engine.step, plan), repeats, partial(engine.step, release))
    engine.step(release)
    return seconds


def their_decode_step(
    model: Any, batch: int, context: int, vocab: int
) -> tuple[Callable[[], object], Callable[[], None]]:
    """A decode step of ``batch`` requests on a StaticCache filled by a real prefill of
    ``context - 1`` tokens, and what restarts it.

    transformers 5 takes positions from the cache's own length, not from
    ``cache_position``; resetting that length before each step makes every timed
    step rewrite position ``context - 1`` and attend ``context`` keys, as ours does.
    """
    cache = transformers.StaticCache(config=model.config, max_cache_len=context)
    model(torch.randint(vocab, (batch, context - 1)), cache=cache, logits_to_keep=1)
    step = partial(model, torch.randint(vocab, (batch, 1)), cache=cache, logits_to_keep=1)

    def restart() -> None:
        for layer in cache.layers:
            layer.cumulative_length.fill_(context - 1)

    return step, restart


def their_decode_s(model: Any, batch: int, context: int, steps: int, vocab: int) -> float:
    """Median seconds of ``their_decode_step``."""
    step, restart = their_decode_step(model, batch, context, vocab)
    return median_s(step, steps, restart)


def measure_dtype(args: argparse.Namespace, dtype_name: str) -> list[Row]:
    ours, theirs = load_models(args, dtype_name)
    config, context, rows = ours.config, args.context, []
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, config.vocab_size) for _ in range(n)]

    mixed = [tokens(rng.randint(args.mixed_min, args.mixed_max)) for _ in range(args.num_mixed)]
    max_batch = max(args.batches)
    num_blocks = (
        max_batch * blocks_for(context, BLOCK_SIZE)
        + blocks_for(args.prefill_len, BLOCK_SIZE)
        + sum(blocks_for(len(p), BLOCK_SIZE) for p in mixed)
    )
    budget = KVCacheBudget(
        num_bytes=num_blocks * bytes_per_block(config, BLOCK_SIZE, ours.dtype),
        block_size=BLOCK_SIZE,
    )
    engine = Engine(ours, budget, "cpu", compile_decode=args.compile_decode)
    # The compiled decode attention (None without --compile-decode), kept across the sweep.
    decode_kernel = engine.paths.paged_attention
    request_ids = [f"r{i}" for i in range(max_batch)]
    fill_s = prefill_in_groups(engine, {rid: tokens(context - 1) for rid in request_ids})
    group_size = fill_s[0][1]
    fill_median = statistics.median(s for s, n in fill_s if n == group_size)
    new, attended = group_size * (context - 1), group_size * prefill_attended(context - 1)
    rows.append(row("prefill fill", dtype_name, "cpu", group_size, new, attended, fill_median))

    backends = {name: make_backend(name, ours.dtype, decode_kernel) for name in args.backends}
    for batch in args.batches:
        # Ours with each backend and theirs taking turns step by step.
        runs: list[tuple[Callable[[], object], Callable[[], object]]] = []
        for backend in backends.values():

            def before(backend: Any = backend, batch: int = batch) -> None:
                use_backend(engine, backend)
                rewind(engine, request_ids[:batch], context - 1)

            decode = decode_plan(request_ids[:batch])
            runs.append((partial(engine.step, decode), before))
        runs.append(their_decode_step(theirs, batch, context, config.vocab_size))
        *ours_s, their_s = interleaved_median_s(runs, args.steps)
        for backend_name, step_s in zip(backends, ours_s, strict=True):
            rows.append(row("decode", dtype_name, backend_name, batch, batch, batch * context,
                            step_s))  # fmt: skip
        rows.append(row("decode", dtype_name, "transformers", batch, batch, None, their_s))
    for backend_name, backend in backends.items():
        use_backend(engine, backend)
        step_s = our_prefill_s(engine, [tokens(args.prefill_len)], args.repeats)
        attended = prefill_attended(args.prefill_len)
        rows.append(row("prefill", dtype_name, backend_name, 1, args.prefill_len, attended, step_s))
        step_s = our_prefill_s(engine, mixed, args.repeats)
        new, attended = sum(map(len, mixed)), sum(prefill_attended(len(p)) for p in mixed)
        rows.append(row("mixed", dtype_name, backend_name, len(mixed), new, attended, step_s))

    prompt = torch.tensor([tokens(args.prefill_len)])
    step_s = median_s(partial(theirs, prompt, logits_to_keep=1), args.repeats)
    rows.append(row("prefill", dtype_name, "transformers", 1, args.prefill_len, None, step_s))
    longest = max(map(len, mixed))
    padded = torch.zeros((len(mixed), longest), dtype=torch.int64)
    mask = torch.zeros_like(padded)
    for index, prompt_ids in enumerate(mixed):
        padded[index, : len(prompt_ids)] = torch.tensor(prompt_ids)
        mask[index, : len(prompt_ids)] = 1
    step_s = median_s(partial(theirs, padded, attention_mask=mask, logits_to_keep=1), args.repeats)
    new = sum(map(len, mixed))
    rows.append(row("mixed", dtype_name, "transformers (padded)", len(mixed), new, None, step_s))
    return rows


def measure_overhead(steps: int) -> dict[str, float]:
    """Batch-1 decode of 30 layers of width 64: nearly all of it is per-op dispatch."""
    config = tiny_config(OVERHEAD_LAYERS, 64, 1, 1)
    ours, theirs = random_models(config, torch.float32)
    budget = KVCacheBudget(num_bytes=4 * bytes_per_block(config, BLOCK_SIZE, torch.float32))
    engine = Engine(ours, budget, "cpu")
    step_alone(engine, prefill_plan({"o": [5] * 15}))
    decode = decode_plan(["o"])
    our_s = median_s(partial(engine.step, decode), steps, partial(rewind, engine, ["o"], 15))
    their_s = their_decode_s(theirs, 1, 16, steps, config.vocab_size)
    return {
        "num_layers": OVERHEAD_LAYERS,
        "step_ms": our_s * 1000,
        "us_per_layer": our_s * 1e6 / OVERHEAD_LAYERS,
        "transformers_step_ms": their_s * 1000,
        "transformers_us_per_layer": their_s * 1e6 / OVERHEAD_LAYERS,
    }


def fit_cost_model(rows: list[Row]) -> dict[str, float]:
    """Non-negative least squares of relative error (small decodes count as much as
    big prefills): the best fit over every subset of the three terms kept >= 0."""
    design = torch.tensor(
        [[1.0, r["new_tokens"], r["attended_tokens"]] for r in rows], dtype=torch.float64
    )
    step_s = torch.tensor([r["step_ms"] / 1000 for r in rows], dtype=torch.float64)
    scale = design.abs().amax(0)
    weighted = design / scale / step_s[:, None]
    best: tuple[float, torch.Tensor] | None = None
    for size in (1, 2, 3):
        for columns in map(list, itertools.combinations(range(3), size)):
            solution = torch.linalg.lstsq(
                weighted[:, columns], torch.ones(len(rows), 1, dtype=torch.float64)
            ).solution
            coefficients = torch.zeros(3, dtype=torch.float64)
            coefficients[columns] = solution[:, 0].double()
            if (coefficients < 0).any():
                continue
            error = float((weighted @ coefficients - 1).norm())
            if best is None or error < best[0]:
                best = (error, coefficients / scale)
    assert best is not None
    a_s, b_s, c_s = best[1].tolist()
    worst = float(((design @ best[1]) / step_s - 1).abs().max())
    return {"a_s": a_s, "b_s_per_token": b_s, "c_s_per_attended_token": c_s,
            "max_relative_error": worst, "num_points": len(rows)}  # fmt: skip


def evaluate_targets(rows: list[Row], dtypes: list[str]) -> list[Row]:
    def step_ms(measurement: str, dtype: str, impl: str, batch: int) -> float | None:
        for r in rows:
            if (r["measurement"], r["dtype"], r["impl"], r["batch"]) == (
                measurement, dtype, impl, batch,
            ):  # fmt: skip
                return float(r["step_ms"])
        return None

    targets = []
    for dtype in dtypes:
        checks = [(f"cpu decode step at batch {b} <= transformers", "decode", "transformers", b)
                  for b in (32, 64)]  # fmt: skip
        checks.append(("single-request decode step <= transformers", "decode", "transformers", 1))
        mixed = next((r["batch"] for r in rows if r["measurement"] == "mixed"), 0)
        checks.append(
            ("mixed batch < transformers padded", "mixed", "transformers (padded)", mixed)
        )
        for name, measurement, impl, batch in checks:
            ours, theirs = (
                step_ms(measurement, dtype, "cpu", batch),
                step_ms(measurement, dtype, impl, batch),
            )
            if ours is None or theirs is None:
                continue
            targets.append({"target": name, "dtype": dtype, "ours_ms": ours,
                            "transformers_ms": theirs, "ratio": ours / theirs,
                            "result": "PASS" if ours <= theirs else "MISS"})  # fmt: skip
    return targets


def print_report(result: dict[str, Any]) -> None:
    print("| measurement | dtype | impl | batch | new tokens | attended | step ms | tokens/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in result["results"]:
        attended = "" if r["attended_tokens"] is None else f"{r['attended_tokens']:,}"
        cells = (r["measurement"], r["dtype"], r["impl"], r["batch"], f"{r['new_tokens']:,}",
                 attended, f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    overhead = result["overhead"]
    print(f"\nOverhead: batch-1 decode of {overhead['num_layers']} layers of width 64 takes "
          f"{overhead['step_ms']:.2f} ms, {overhead['us_per_layer']:.0f} µs per layer "
          f"(transformers {overhead['transformers_step_ms']:.2f} ms, "
          f"{overhead['transformers_us_per_layer']:.0f} µs per layer). The math is nearly "
          "free at this width: this isolates per-op dispatch (Python, op launch).")  # fmt: skip
    model = result["cost_model"]
    print(f"\nCost model ({result['cost_model_dtype']}, cpu backend, {model['num_points']} steps): "
          f"step_s = {model['a_s']:.4g} + {model['b_s_per_token']:.4g}·new + "
          f"{model['c_s_per_attended_token']:.4g}·attended "
          f"(worst relative error {model['max_relative_error']:.0%})\n")  # fmt: skip
    for t in result["targets"]:
        print(f"{t['result']}  {t['target']} ({t['dtype']}): ours {t['ours_ms']:.1f} ms, "
              f"transformers {t['transformers_ms']:.1f} ms ({t['ratio']:.2f}×)")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: small and fast")
    parser.add_argument("--config", choices=("model", "tiny"), default="model",
                        help="the real model, or a tiny random one (no files)")  # fmt: skip
    parser.add_argument("--model", help="model directory (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", help="comma list; default float32 (+bfloat16 if native)")
    parser.add_argument("--backends", default=",".join(BACKEND_NAMES))
    parser.add_argument(
        "--weights", choices=WEIGHT_FORMATS, default="float32",
        help="ours packed so (the worker's --weights; float32: exact, as transformers)",
    )  # fmt: skip
    parser.add_argument(
        "--compile-decode", action=argparse.BooleanOptionalAction, default=True,
        help="ours with the worker's compiled decodes (a lone one's graph, batches' attention)",
    )  # fmt: skip
    parser.add_argument("--batches", help="decode batch sizes (default 1,8,32,64; quick 1,8)")
    parser.add_argument("--context", type=int, help="decode context (default 256; quick 32)")
    parser.add_argument("--steps", type=int, help="timed decode steps (default 5; quick 2)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "engine.json")
    args = parser.parse_args(argv)
    quick = args.quick
    args.batches = [int(b) for b in (args.batches or ("1,8" if quick else "1,8,32,64")).split(",")]
    args.context = args.context or (32 if quick else 256)
    args.steps = args.steps or (2 if quick else 5)
    args.backends = args.backends.split(",")
    default_dtypes = "float32,bfloat16" if cpu_has_native_bf16() else "float32"
    args.dtypes = (args.dtype or default_dtypes).split(",")
    for name in args.dtypes:
        if name not in DTYPES:
            parser.error(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    args.repeats = 1 if quick else 3
    args.prefill_len = 64 if quick else 512
    args.num_mixed, args.mixed_min, args.mixed_max = (4, 16, 64) if quick else (8, 32, 512)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    with torch.inference_mode():
        rows = [r for dtype in args.dtypes for r in measure_dtype(args, dtype)]
        overhead = measure_overhead(args.steps * 4)
    default_dtype = next((d for d, t in DTYPES.items() if t == choose_dtype(CPU)), "float32")
    fit_dtype = default_dtype if default_dtype in args.dtypes else args.dtypes[0]
    cost_models = {
        dtype: fit_cost_model([r for r in rows if r["impl"] == "cpu" and r["dtype"] == dtype])
        for dtype in args.dtypes
    }
    machine = torch_machine()
    machine |= {"transformers": transformers.__version__, "native_bf16": cpu_has_native_bf16()}
    result = {
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": rows,
        "overhead": overhead,
        "targets": evaluate_targets(rows, args.dtypes),
        "cost_model": cost_models[fit_dtype],
        "cost_model_dtype": fit_dtype,
        "cost_models": cost_models,
        "run_s": time.perf_counter() - started,
    }
    print_report(result)
    write_json(args.out, result)
    print(f"\n{time.perf_counter() - started:.0f} s; wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
