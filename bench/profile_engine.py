"""Where an engine step's time goes on the CPU: matmuls, attention, pointwise ops, host work.

    python -m bench.profile_engine [--model DIR] [--scenarios decode_b1,decode_b64,prefill,mixed]
                                   [--context 512] [--weights F] [--compile-decode]
                                   [--no-py-spy] [--out FILE.json]

Drives ``Engine.step`` directly on the packaged model (fp32 activations, the
``cpu`` attention backend, 2 intra-op threads; eager unless ``--compile-decode``,
the worker's default: a lone decode's graph then shows as one call, a batch's
compiled attention as "attention") for four steps:

- ``decode_b1``: one request decoding at context ``--context`` (512);
- ``decode_b64``: 64 requests decoding, each at context 512;
- ``prefill``: one 512-token prompt in one step;
- ``mixed``: a 256-token prefill chunk (the first half of a 512-token prompt)
  beside 32 decodes at context 512;
- ``decode_b1_narrow``: ``decode_b1`` on a twin of the model with the same 30
  layers, heads and ops but widths of 72 (random weights), where the math is
  nearly free: what is left is per-op dispatch and host work (``--no-narrow``
  skips it).

Three views of each step, so they can check one another:

1. **regions** (wall clock): the engine's and the model's functions are wrapped
   with timers that charge each call its own time minus its children's
   (exclusive time): ``F.linear`` (matmuls), the attention backend's ``attend``
   and ``prepare``, the K/V store, the pointwise ops, ``Engine._validate``,
   the sampler, every ``torch.tensor`` made from Python lists; what is left of
   ``forward`` is its Python loop and the embedding lookup, what is left of
   ``step`` the layout building and bookkeeping. The timers cost about 1 µs a
   call; the table shows the plain step time beside the instrumented one.
2. **aten ops** (torch profiler, self CPU time per step): splits attention into
   the K/V gather (``index_select``), SDPA and the indexing around it.
3. **py-spy** (``--native``, 100 Hz, a separate process looping the step):
   the share of samples whose innermost frame is a BLAS kernel, other native
   code (torch ops), or the Python interpreter, and the Python functions the
   samples fall in.

The 63 other requests of the batch-64 decode get the first request's K/V
copied into their own blocks instead of 63 real prefills (about a minute):
the step attends the same number of real K/V values either way.

Prints the tables and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import gpu_worker.attention as attention_module
import gpu_worker.engine as engine_module
from bench.child_process import child_environment, module_argv
from bench.engine_plans import BLOCK_SIZE, SAMPLING, release_plan, rewind
from bench.machine import lscpu_machine
from bench.output import RESULTS_DIR, log, write_json
from bench.timing import times_s
from gpu_worker.block_tables import blocks_for
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.llama import LlamaModel
from gpu_worker.local_blocks import grant_free_blocks, step_alone
from gpu_worker.model_loading import load_model
from gpu_worker.weights import random_weights
from shared.messages import PrefillChunk, RequestSpec, StepPlan
from shared.settings import WEIGHT_FORMATS, model_location

SCENARIOS = ("decode_b1", "decode_b64", "prefill", "mixed")
PREFILL_LEN = 512
MIXED_CHUNK = 256
MIXED_DECODES = 32
MAX_BATCH = 64
# Timed steps per scenario (median), after one warm-up.
STEPS = {"decode_b1": 20, "decode_b64": 5, "prefill": 3, "mixed": 3}
PY_SPY_SECONDS = 12
# Region -> category of the summary table.
CATEGORY = {
    "linear": "matmul (F.linear)",
    "attend": "attention (gather + SDPA)",
    "prepare": "attention prepare (masks, indices)",
    "kv_store": "K/V store (index_copy_)",
    "add_rms_norm": "pointwise: residual add + RMSNorm",
    "rope": "pointwise: split + RoPE",
    "silu_mul": "pointwise: SwiGLU",
    "rotary_inputs": "pointwise: RoPE tables",
    "forward": "forward Python (layer loop, embedding, logits rows)",
    "validate": "host: plan validation",
    "tensor": "host: torch.tensor from lists",
    "sample": "host: sampling",
    "step": "host: layout, slots, bookkeeping",
}
CATEGORIES = list(dict.fromkeys(CATEGORY.values()))


class RegionTimer:
    """Exclusive wall time per region: a call's time minus that of regions it calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._child_s: list[float] = []

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._child_s.append(0.0)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                children = self._child_s.pop()
                self.seconds[name] += elapsed - children
                self.calls[name] += 1
                if self._child_s:
                    self._child_s[-1] += elapsed

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(engine: Engine, timer: RegionTimer) -> Callable[[], None]:
    """Wrap the step's functions with ``timer``; returns what undoes it."""
    patches: list[tuple[object, str, object]] = []

    def patch(owner: object, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)
        patches.append((owner, attribute, original))
        setattr(owner, attribute, timer.wrap(name, original))

    model, ops = engine.model, engine.model.pointwise
    patch(engine, "step", "step")
    patch(engine, "_validate", "validate")
    patch(engine_module, "sample_rows", "sample")
    patch(torch, "tensor", "tensor")
    patch(model, "forward", "forward")
    patch(F, "linear", "linear")
    # The eager forward's backend, and the one whose decodes take the paged attention.
    for backend in (engine.paths.backend, engine.paths.paged_backend):
        if backend is not None:
            patch(backend, "attend", "attend")
            patch(backend, "prepare", "prepare")
    patch(attention_module, "_index_copy_kv", "kv_store")
    patch(ops, "add_rms_norm", "add_rms_norm")
    patch(ops, "rope_and_store_kv", "rope")
    patch(ops, "silu_mul", "silu_mul")
    patch(ops, "rotary_inputs", "rotary_inputs")

    def undo() -> None:
        for owner, attribute, original in reversed(patches):
            if isinstance(owner, types.ModuleType):
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)  # the instance attribute shadowed the method

    return undo


class Scenarios:
    """An engine holding 64 requests at context ``context - 1``, and the four steps."""

    def __init__(self, model: LlamaModel, context: int, compile_decode: bool = False) -> None:
        self.context = context
        num_blocks = MAX_BATCH * blocks_for(context, BLOCK_SIZE) + 2 * blocks_for(
            PREFILL_LEN, BLOCK_SIZE
        )
        budget = KVCacheBudget(
            num_bytes=num_blocks * bytes_per_block(model.config, BLOCK_SIZE, model.dtype),
            block_size=BLOCK_SIZE,
        )
        self.engine = Engine(model, budget, "cpu", compile_decode=compile_decode)
        self.vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(3, self.vocab, (PREFILL_LEN,), generator=generator).tolist()
        self.request_ids = [f"r{i}" for i in range(MAX_BATCH)]
        self._fill()

    def _fill(self) -> None:
        engine, first = self.engine, self.request_ids[0]
        cached = self.context - 1
        step_alone(
            engine,
            StepPlan(
                "profile", 0, 0,
                new_requests=[RequestSpec(first, cached, SAMPLING)],
                prefill_chunks=[PrefillChunk(first, self.prompt[:cached], 0)],
            )
        )  # fmt: skip
        source = engine._requests[first]
        cache = engine.kv_cache
        # Each request's table holds the decoded position too.
        num_blocks = blocks_for(self.context, cache.block_size)
        cache.tables.extend(
            first, cache.tables.unreferenced()[: num_blocks - cache.tables.num_held(first)]
        )
        source_slots = torch.tensor(cache.slot_ids(first, 0, cached))
        for request_id in self.request_ids[1:]:
            request = engine._admit(RequestSpec(request_id, cached, SAMPLING))
            request.num_cached_tokens = cached
            request.last_token_id = source.last_token_id
            engine._requests[request_id] = request
            cache.tables.extend(request_id, cache.tables.unreferenced()[:num_blocks])
            slots = torch.tensor(cache.slot_ids(request_id, 0, cached))
            for layer_keys, layer_values in zip(cache.keys, cache.values, strict=True):
                layer_keys[slots] = layer_keys[source_slots]
                layer_values[slots] = layer_values[source_slots]

    def rewind(self, request_ids: list[str]) -> None:
        # Each timed decode rewrites position context - 1 and attends context keys.
        rewind(self.engine, request_ids, self.context - 1)

    def release(self, request_id: str) -> None:
        self.engine.step(release_plan([request_id]))

    def release_if_running(self, request_id: str) -> None:
        """A request the last timed step left running leaves, so that its prompt's plan
        binds again (the timing loops reset before each step, not after the last)."""
        if request_id in self.engine.active_request_ids:
            self.release(request_id)

    def step_and_reset(self, name: str) -> tuple[Callable[[], object], Callable[[], None]]:
        """The step of scenario ``name`` and what restores the engine before it."""
        engine = self.engine
        if name in ("decode_b1", "decode_b64"):
            batch = 1 if name == "decode_b1" else MAX_BATCH
            ids = self.request_ids[:batch]
            plan = StepPlan("profile", 0, 0, decode_request_ids=ids)
            return partial(engine.step, plan), partial(self.rewind, ids)
        if name == "prefill":
            self.release_if_running("p")
            plan = StepPlan(
                "profile", 0, 0,
                new_requests=[RequestSpec("p", PREFILL_LEN, SAMPLING)],
                prefill_chunks=[PrefillChunk("p", self.prompt, 0)],
            )  # fmt: skip
            plan = grant_free_blocks(engine, plan)  # the same blocks again after each release
            return partial(engine.step, plan), partial(self.release, "p")
        if name == "mixed":
            self.release_if_running("m")
            ids = self.request_ids[:MIXED_DECODES]
            plan = StepPlan(
                "profile", 0, 0,
                new_requests=[RequestSpec("m", PREFILL_LEN, SAMPLING)],
                prefill_chunks=[PrefillChunk("m", self.prompt[:MIXED_CHUNK], 0)],
                decode_request_ids=ids,
            )  # fmt: skip

            plan = grant_free_blocks(engine, plan)

            def reset() -> None:
                self.release("m")
                self.rewind(ids)

            return partial(engine.step, plan), reset
        raise ValueError(f"unknown scenario {name!r}")


def region_breakdown(scenarios: Scenarios, name: str) -> dict[str, Any]:
    run, reset = scenarios.step_and_reset(name)
    num_steps = STEPS[name]
    plain_s = statistics.median(times_s(run, num_steps, reset))
    timer = RegionTimer()
    undo = instrument(scenarios.engine, timer)
    try:
        run, reset = scenarios.step_and_reset(name)  # bound to the wrapped step
        reset()
        run()
        instrumented = []
        regions_s: dict[str, float] = collections.defaultdict(float)
        calls: dict[str, int] = collections.defaultdict(int)
        for _ in range(num_steps):
            reset()  # a release step, also instrumented: not counted
            timer.reset()
            started = time.perf_counter()
            run()
            instrumented.append(time.perf_counter() - started)
            for region, seconds in timer.seconds.items():
                regions_s[region] += seconds
                calls[region] += timer.calls[region]
    finally:
        undo()
    per_step_ms = {k: v / num_steps * 1000 for k, v in regions_s.items()}
    categories = {c: 0.0 for c in CATEGORIES}
    for region, ms in per_step_ms.items():
        categories[CATEGORY[region]] += ms
    return {
        "plain_step_ms": plain_s * 1000,
        "instrumented_step_ms": statistics.median(instrumented) * 1000,
        "regions_ms": per_step_ms,
        "calls_per_step": {k: v / num_steps for k, v in calls.items()},
        "categories_ms": categories,
    }


def aten_breakdown(scenarios: Scenarios, name: str, top: int = 12) -> dict[str, Any]:
    run, reset = scenarios.step_and_reset(name)
    num_steps = max(2, STEPS[name] // 2)
    reset()
    run()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            reset()
            started = time.perf_counter()
            run()
            walls.append(time.perf_counter() - started)
    # Self time of ops run by the reset (release steps) is small; count only ops
    # the profiled steps ran, per step.
    ops = [
        (event.key, event.self_cpu_time_total / 1000 / num_steps, event.count / num_steps)
        for event in prof.key_averages()
    ]
    ops.sort(key=lambda item: -item[1])
    total_self_ms = sum(ms for _, ms, _ in ops)
    return {
        "profiled_step_ms": statistics.median(walls) * 1000,
        "aten_self_total_ms": total_self_ms,
        "top_ops": [{"op": op, "self_ms": ms, "calls": n} for op, ms, n in ops[:top]],
    }


def py_spy_breakdown(
    model_dir: Path, context: int, name: str, weight_format: str, compile_decode: bool
) -> dict[str, Any]:
    """Sample a child process that loops the step; classify each sample's innermost frame."""
    py_spy = Path(sys.executable).with_name("py-spy")
    if not py_spy.exists():
        return {"error": f"py-spy not found beside {sys.executable} (pip install py-spy)"}
    child_args = ["--loop", name, "--context", str(context), "--weights", weight_format]
    if compile_decode:
        child_args.append("--compile-decode")
    child = subprocess.Popen(
        module_argv("bench.profile_engine", *child_args, "--model", str(model_dir)),
        stdout=subprocess.PIPE, text=True, env=child_environment(),
    )  # fmt: skip
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            return {"error": "the looping child did not start"}
        with tempfile.TemporaryDirectory() as folder:
            raw = Path(folder) / "stacks.txt"
            # --native needs the target stopped at each sample (no --nonblocking); at
            # 100 Hz that slows the loop by a few per cent, the shares stay put.
            recorded = subprocess.run(
                [str(py_spy), "record", "--pid", str(child.pid), "--native", "--rate", "100",
                 "--duration", str(PY_SPY_SECONDS), "--format", "raw", "--output", str(raw)],
                capture_output=True, text=True,
            )  # fmt: skip
            if recorded.returncode != 0:
                return {"error": f"py-spy failed: {recorded.stderr.strip()[-300:]}"}
            lines = raw.read_text().splitlines()
    finally:
        child.terminate()
        child.wait()
    leaf_kinds: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if "step" not in stack:  # only the thread running Engine.step
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        leaf = frames[-1]
        lowered = leaf.lower()
        if ".py:" in leaf:
            leaf_kinds["python interpreter"] += count
        elif any(word in lowered for word in ("gemm", "mkl", "dnnl", "blas", "sgemv", "brgemm")):
            leaf_kinds["BLAS kernel"] += count
        elif any(word in lowered for word in ("_pyeval", "python", "pyobject", "_py")):
            leaf_kinds["python interpreter"] += count
        else:
            leaf_kinds["other native (torch ops, allocator, OpenMP)"] += count
        python_frames = [f for f in frames if ".py:" in f and "gpu_worker" in f]
        if python_frames:
            innermost = python_frames[-1]
            function, _, where = innermost.partition(" (")
            functions[f"{function} ({where.split(':')[0].split('/')[-1]})"] += count
    if not total:
        return {"error": "py-spy recorded no samples of the step"}
    return {
        "samples": total,
        "leaf_share": {k: v / total for k, v in leaf_kinds.most_common()},
        "innermost_gpu_worker_function_share": {k: v / total for k, v in functions.most_common(10)},
    }


def narrow_twin(model: LlamaModel) -> LlamaModel:
    """The same layers, heads and ops with widths so small that the math is nearly free:
    what is left of a step is dispatch and host work."""
    config = dataclasses.replace(
        model.config, hidden_size=72, intermediate_size=128, head_dim=8, vocab_size=256
    )
    cpu = torch.device("cpu")
    return LlamaModel(config, random_weights(config, cpu, torch.float32), cpu, torch.float32)


def loop_forever(
    model_dir: Path, context: int, name: str, weight_format: str, compile_decode: bool
) -> None:
    """The py-spy target: set up, say ready, then step until terminated."""
    model = load_model(model_dir, "cpu", "float32", weight_format)
    scenarios = Scenarios(model, context, compile_decode)
    run, reset = scenarios.step_and_reset(name)
    reset()
    run()
    print("ready", flush=True)
    while True:
        reset()
        run()


def print_tables(results: dict[str, Any]) -> None:
    names = list(results["scenarios"])
    print("\n### Step breakdown (wall clock, exclusive time per step)\n")
    print("| category | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for category in CATEGORIES:
        cells = []
        for name in names:
            regions = results["scenarios"][name]["regions"]
            ms = regions["categories_ms"][category]
            share = 100 * ms / sum(regions["categories_ms"].values())
            cells.append(f"{ms:.1f} ms ({share:.0f} %)")
        print(f"| {category} | " + " | ".join(cells) + " |")
    for key, label in (("instrumented_step_ms", "step, instrumented"),
                       ("plain_step_ms", "step, plain")):  # fmt: skip
        cells = [f"{results['scenarios'][n]['regions'][key]:.1f} ms" for n in names]
        print(f"| **{label}** | " + " | ".join(cells) + " |")
    print("\n### aten ops (torch profiler, self CPU ms per step)\n")
    for name in names:
        aten = results["scenarios"][name]["aten"]
        print(f"{name}: profiled step {aten['profiled_step_ms']:.1f} ms, "
              f"sum of op self times {aten['aten_self_total_ms']:.1f} ms")  # fmt: skip
        print("| op | self ms | calls |\n|---|---:|---:|")
        for op in aten["top_ops"]:
            print(f"| {op['op']} | {op['self_ms']:.2f} | {op['calls']:.0f} |")
        print()
    if any("py_spy" in results["scenarios"][n] for n in names):
        print("### py-spy (--native, innermost frame of the stepping thread)\n")
        for name in names:
            spy = results["scenarios"][name].get("py_spy")
            if spy is None:
                continue
            if "error" in spy:
                print(f"{name}: {spy['error']}")
                continue
            kinds = ", ".join(f"{k} {100 * v:.0f} %" for k, v in spy["leaf_share"].items())
            top = ", ".join(
                f"{k} {100 * v:.0f} %"
                for k, v in list(spy["innermost_gpu_worker_function_share"].items())[:6]
            )
            print(f"- {name} ({spy['samples']} samples): {kinds}; in: {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: packaged)"
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--context", type=int, default=512, help="K/V tokens each decode attends")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--weights", choices=WEIGHT_FORMATS, default="float32", help="the worker's --weights"
    )
    parser.add_argument(
        "--compile-decode", action="store_true",
        help="the worker's compiled decodes (a lone one's graph, batches' attention)",
    )  # fmt: skip
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--no-narrow", action="store_true", help="skip the narrow-twin decode")
    parser.add_argument("--loop", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "profile_engine.json")
    args = parser.parse_args()  # fmt: skip
    torch.set_num_threads(args.threads)
    model_dir = model_location(model_dir=args.model).model_dir
    if args.loop:
        loop_forever(model_dir, args.context, args.loop, args.weights, args.compile_decode)
        return
    started = time.perf_counter()
    model = load_model(model_dir, "cpu", "float32", args.weights)
    scenarios = Scenarios(model, args.context, args.compile_decode)
    results: dict[str, Any] = {"machine": lscpu_machine(with_torch=True),
                               "model_dir": str(model_dir),
                               "context": args.context, "weights": args.weights,
                               "scenarios": {}}  # fmt: skip
    for name in args.scenarios.split(","):
        log(f"profiling {name} ...")
        entry = {
            "regions": region_breakdown(scenarios, name),
            "aten": aten_breakdown(scenarios, name),
        }
        results["scenarios"][name] = entry
    if not args.no_narrow:
        log("profiling decode_b1 of the narrow twin ...")
        narrow = Scenarios(narrow_twin(model), args.context)
        results["scenarios"]["decode_b1_narrow"] = {
            "regions": region_breakdown(narrow, "decode_b1"),
            "aten": aten_breakdown(narrow, "decode_b1"),
        }
        del narrow
    if not args.no_py_spy:
        del scenarios, model  # one process at a time on the two cores
        for name in [n for n in results["scenarios"] if n in SCENARIOS]:
            log(f"py-spy {name} ...")
            results["scenarios"][name]["py_spy"] = py_spy_breakdown(
                model_dir, args.context, name, args.weights, args.compile_decode
            )
    results["wall_s"] = time.perf_counter() - started
    print_tables(results)
    write_json(args.out, results)
    print(f"\nwrote {args.out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
