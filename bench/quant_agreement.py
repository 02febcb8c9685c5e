"""Packed weights (``--weights float16`` / ``int4``) against fp32: agreement and step times.

    python -m bench.quant_agreement [--model DIR] [--formats float16]
                                    [--max-tokens 64] [--quick] [--out FILE.json]

On the packaged SmolLM2 (CPU, 2 threads, the ``cpu`` attention backend), for
float32 and each packed format, driving ``Engine.step`` directly:

1. **agreement**: greedy continuations (``--max-tokens``, stopping at the
   model's end of turn) of 20 fixed chat prompts, each prompt run alone; per
   format, the fraction of prompts whose continuation is identical to fp32's
   and the mean length of the common prefix. The same prompts are also run as
   one batch (one prefill step for all, then decode steps together), compared
   with the same format run alone: int4 takes its bf16 copy for steps of more
   than ``INT4_MAX_ROWS`` rows, so a request's tokens may depend on its
   neighbours; fp32's own batched-vs-alone figure is the baseline.
2. **first-step logits**: the relative L2 error ``|l - l_fp32| / |l_fp32|``
   of each prompt's prefill logits (max and mean over prompts), the largest
   absolute difference, and whether the first token is the same.
3. **the load-time check**: ``load_model`` keeps packed weights only when
   their logits of a fixed 32-token probe prompt stay within
   ``MAX_PROBE_LOGIT_ERROR`` of fp32's; the table shows each format's probe
   error and whether it would be kept. This bench packs without that check.
4. **step times**: decode at batch 1 and 64 with every request attending
   ``--context`` (256) tokens, and one 512-token prefill (medians, as in
   ``bench/engine.py``); the formats take turns for ``--rounds`` rounds and
   the table shows the median and the least round.

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
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
from bench.machine import lscpu_machine
from bench.output import RESULTS_DIR, write_json
from bench.timing import in_turns, median_s
from gpu_worker.block_tables import blocks_for
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.llama import LlamaModel
from gpu_worker.local_blocks import grant_free_blocks, step_alone
from gpu_worker.model_config import load_model_config
from gpu_worker.model_loading import probe_logits
from gpu_worker.quantized_linear import (
    MAX_PROBE_LOGIT_ERROR,
    WEIGHT_FORMATS,
    pack_weights,
    weight_format_of,
)
from gpu_worker.weights import load_weights
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from shared.settings import model_location

CPU = torch.device("cpu")
PREFILL_TOKENS = 512
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for a good night's sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I make a cup of green tea?",
    "Why is the sky blue?",
    "Write a short story opening about a lighthouse keeper.",
    "What are prime numbers? Give a few examples.",
    "Suggest a name for a friendly robot.",
    "How does a bicycle stay upright?",
    "List the planets of the solar system in order.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a hash table is.",
    "Write a polite email declining a meeting invitation.",
    "What causes the seasons on Earth?",
    "Give me a simple recipe for pancakes.",
    "What is the Pythagorean theorem?",
]


def chat_prompts(model_dir: Path, num_prompts: int) -> dict[str, list[int]]:
    """Each prompt as a one-turn chat, through the model's own chat template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = {}
    for index, text in enumerate(PROMPTS[:num_prompts]):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        prompts[f"prompt{index}"] = [int(i) for i in ids]
    return prompts


def generate(
    engine: Engine, prompts: dict[str, list[int]], max_tokens: int
) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Greedy continuations of ``prompts`` run together, and each one's prefill logits."""
    sampling = SamplingParams(max_tokens=max_tokens)  # temperature 0: greedy
    plan = StepPlan(
        worker_id="bench", epoch=0, step_index=0,
        new_requests=[RequestSpec(rid, len(ids), sampling) for rid, ids in prompts.items()],
        prefill_chunks=[PrefillChunk(rid, ids, 0) for rid, ids in prompts.items()],
    )  # fmt: skip
    model = engine.model
    captured: list[torch.Tensor] = []

    def recording_forward(**kwargs: Any) -> torch.Tensor:
        logits = LlamaModel.forward(model, **kwargs)
        captured.append(logits.clone())
        return logits

    model.forward = recording_forward  # type: ignore[method-assign]
    try:
        output = step_alone(engine, plan)
    finally:
        del model.forward  # back to the class's method
    first_logits = dict(zip(prompts, captured[0], strict=True))  # chunks' order
    continuations: dict[str, list[int]] = {rid: [] for rid in prompts}
    running = set(prompts)
    step_index = 1
    while True:
        assert not output.failed, output.failed
        for token in output.tokens:
            continuations[token.request_id].append(token.token_id)
            if token.finish_reason is not None:
                running.discard(token.request_id)
        if not running:
            return continuations, first_logits
        decode = [rid for rid in prompts if rid in running]
        output = step_alone(engine, StepPlan("bench", 0, step_index, decode_request_ids=decode))
        step_index += 1


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def agreement(ours: dict[str, list[int]], reference: dict[str, list[int]]) -> dict[str, Any]:
    prefixes = [common_prefix(ours[rid], reference[rid]) for rid in reference]
    return {
        "identical_fraction": sum(ours[r] == reference[r] for r in reference) / len(reference),
        "mean_common_prefix": statistics.mean(prefixes),
        "mean_reference_length": statistics.mean(len(t) for t in reference.values()),
        "common_prefix_per_prompt": prefixes,
    }


def logit_errors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    relative = [float((ours[r] - reference[r]).norm() / reference[r].norm()) for r in reference]
    return {
        "max_relative_l2": max(relative),
        "mean_relative_l2": statistics.mean(relative),
        "max_abs": max(float((ours[r] - reference[r]).abs().max()) for r in reference),
        "first_token_same_fraction": statistics.mean(
            float(int(ours[r].argmax()) == int(reference[r].argmax())) for r in reference
        ),
    }


def fill(engine: Engine, num_requests: int, context: int) -> list[str]:
    """Admit ``num_requests`` requests, each with ``context - 1`` cached tokens."""
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    request_ids = [f"r{i}" for i in range(num_requests)]
    prefill_in_groups(
        engine, {rid: [rng.randrange(3, vocab) for _ in range(context - 1)] for rid in request_ids}
    )
    return request_ids


def time_steps(
    engine: Engine, request_ids: list[str], args: argparse.Namespace
) -> dict[str, float]:
    """Median ms of decode steps (batch b, each attending ``--context``) and of a
    512-token prefill, on an engine ``fill`` prepared."""
    times = {}
    for batch in args.batches:
        decode = decode_plan(request_ids[:batch])
        restart = partial(rewind, engine, request_ids[:batch], args.context - 1)
        seconds = median_s(partial(engine.step, decode), args.steps, restart)
        times[f"decode_b{batch}_ms"] = seconds * 1e3
    vocab = engine.model.config.vocab_size
    prompt = [random.Random(1).randrange(3, vocab) for _ in range(PREFILL_TOKENS)]
    plan, release = prefill_plan({"p": prompt}), release_plan(["p"])
    plan = grant_free_blocks(engine, plan)  # the same blocks again after each release
    seconds = median_s(partial(engine.step, plan), 2, partial(engine.step, release))
    engine.step(release)
    times[f"prefill_{PREFILL_TOKENS}_ms"] = seconds * 1e3
    return times


def load_unchecked(model_dir: Path, weight_format: str) -> LlamaModel:
    """The model in ``weight_format`` without ``load_model``'s probe check, which
    would keep a straying format off the model: here the point is to measure it."""
    config = load_model_config(model_dir)
    weights = load_weights(model_dir, config, CPU, torch.float32)
    weights = pack_weights(weights, weight_format, CPU, torch.float32, probe=None)
    assert weight_format_of(weights) == weight_format, "fell back: see the log line above"
    return LlamaModel(config, weights, CPU, torch.float32)


def measure(args: argparse.Namespace, weight_format: str, prompts: dict[str, list[int]]) -> dict:
    started = time.perf_counter()
    model = load_unchecked(args.model_dir, weight_format)
    load_s = time.perf_counter() - started
    longest = max(map(len, prompts.values())) + args.max_tokens
    timing_blocks = max(args.batches) * blocks_for(args.context, BLOCK_SIZE)
    timing_blocks += blocks_for(PREFILL_TOKENS, BLOCK_SIZE)
    num_blocks = max(timing_blocks, len(prompts) * blocks_for(longest, BLOCK_SIZE))
    budget = KVCacheBudget(
        num_bytes=num_blocks * bytes_per_block(model.config, BLOCK_SIZE, model.dtype),
        block_size=BLOCK_SIZE,
    )
    engine = Engine(model, budget, "cpu")
    alone: dict[str, list[int]] = {}
    first_logits: dict[str, torch.Tensor] = {}
    for rid, ids in prompts.items():
        continuation, logits = generate(engine, {rid: ids}, args.max_tokens)
        alone.update(continuation)
        first_logits.update(logits)
    batched, _ = generate(engine, prompts, args.max_tokens)
    return {"load_s": load_s, "alone": alone, "batched": batched, "first_logits": first_logits,
            "probe_logits": probe_logits(model), "engine": engine}  # fmt: skip


def interleaved_times(
    engines: dict[str, Engine], args: argparse.Namespace
) -> dict[str, dict[str, dict[str, float]]]:
    """Step times of every format, the formats taking turns for ``--rounds``
    rounds, so that a neighbour's load on a shared machine falls on all of them:
    per format and step, the median and the least over rounds."""
    request_ids = {name: fill(e, max(args.batches), args.context) for name, e in engines.items()}
    runs = {name: partial(time_steps, e, request_ids[name], args) for name, e in engines.items()}
    rounds = in_turns(runs, args.rounds)
    return {
        name: {
            step: {
                "median_ms": statistics.median(r[step] for r in results),
                "min_ms": min(r[step] for r in results),
            }
            for step in results[0]
        }
        for name, results in rounds.items()
    }


def print_report(result: dict[str, Any]) -> None:
    formats = result["formats"]
    times = list(formats["float32"]["times"])
    time_headers = " | ".join(
        t.removesuffix("_ms").replace("_", " ") + " ms, median (least)" for t in times
    )
    print("| weights | identical (alone) | mean common prefix | batched = alone | "
          "first-step logit error max / mean | first token same | load-time probe | "
          f"{time_headers} |")  # fmt: skip
    print("|---|" + "---:|" * (6 + len(times)))
    for name, entry in formats.items():
        vs_fp32, batched, logits = entry["agreement"], entry["batched_vs_alone"], entry["logits"]
        cells = [
            name,
            f"{vs_fp32['identical_fraction']:.0%}",
            f"{vs_fp32['mean_common_prefix']:.1f} / {vs_fp32['mean_reference_length']:.1f}",
            f"{batched['identical_fraction']:.0%}",
            f"{logits['max_relative_l2']:.2%} / {logits['mean_relative_l2']:.2%}",
            f"{logits['first_token_same_fraction']:.0%}",
            f"{entry['probe_logit_error']:.2%} "
            + ("(kept)" if entry["kept_by_load_check"] else "(falls back)"),
        ] + [f"{entry['times'][t]['median_ms']:.1f} ({entry['times'][t]['min_ms']:.1f})"
             for t in times]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the prepared SmolLM2)")
    parser.add_argument("--formats", default="float16", help="packed formats beside float32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, formats in turn")
    parser.add_argument("--quick", action="store_true", help="4 prompts, 8 tokens, batch 1, 8")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "quant_agreement.json")
    args = parser.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f != "float32"]
    for name in args.formats:
        if name not in WEIGHT_FORMATS:
            parser.error(f"--formats {name!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.num_prompts, args.max_tokens, args.batches, args.steps = 4, 8, [1, 8], 2
        args.rounds = 1
    args.model_dir = model_location(model_dir=args.model).model_dir
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(2)
    started = time.perf_counter()
    info = lscpu_machine(with_torch=True)
    prompts = chat_prompts(args.model_dir, args.num_prompts)
    runs = {name: measure(args, name, prompts) for name in ["float32", *args.formats]}
    times = interleaved_times({name: run.pop("engine") for name, run in runs.items()}, args)
    reference = runs["float32"]
    formats = {
        name: {
            "load_s": run["load_s"],
            "agreement": agreement(run["alone"], reference["alone"]),
            "batched_vs_alone": agreement(run["batched"], run["alone"]),
            "logits": logit_errors(run["first_logits"], reference["first_logits"]),
            "probe_logit_error": float(
                (run["probe_logits"] - reference["probe_logits"]).norm()
                / reference["probe_logits"].norm()
            ),
            "times": times[name],
            "continuations": run["alone"],
        }
        for name, run in runs.items()
    }
    for entry in formats.values():
        entry["kept_by_load_check"] = entry["probe_logit_error"] <= MAX_PROBE_LOGIT_ERROR
    result = {
        "machine": info,
        "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "num_prompt_tokens": {rid: len(ids) for rid, ids in prompts.items()},
        "formats": formats,
        "run_s": time.perf_counter() - started,
    }
    print_report(result)
    write_json(args.out, result)
    print(f"\n{result['run_s']:.0f} s; wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
