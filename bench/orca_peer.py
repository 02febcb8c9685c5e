"""The Orca trace through ``orcapod up`` and through llama.cpp's ``llama-server``,
side by side in one run, on the same machine and the same client.

    python -m bench.orca_peer [--rates 0.5,1,1.5,2,3] [--duration 60]
                              [--formats Q4_1,Q8_0] [--slots 16] [--threads 2]
                              [--cache-dir ~/.cache/orcapod/llama.cpp]
                              [--out bench/results/orca_peer.json]

For each rate, the same seeded Orca trace (Poisson arrivals for
``--duration`` s, prompts of U(32, 512) random token ids, max_tokens U(1,
128) with ``ignore_eos``) is replayed open loop over the OpenAI completions
API (``orcapod/bench/openai_trace.py``), streamed, greedy:

1. against ``orcapod up`` with its defaults (the ``fair`` policy, the
   worker's ``--weights auto``) on a private redis-server;
2. then against ``llama-server -np --slots -t --threads`` (the build of
   ``bench/llama_cpp.py``, repacking off where it dies) on each GGUF of
   ``--formats`` (the packaged Q4_1, and Q8_0 made from it), 1,024 tokens
   of context per slot (the trace's longest request is 640).

One server runs at a time. Per rate and server: completed requests/s over
the run (first arrival to last answer), output tokens/s, median and p90
normalized latency (latency / generated tokens, Orca's measure) and median
TTFT. A server's saturation throughput is its highest completed requests/s
over the rates; the verdict compares orcapod's with the fastest llama-server
format's. Prints the table, writes JSON. Never run by the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from bench.llama_cpp_build import (
    BUILD_COMMAND,
    DEFAULT_CACHE_DIR,
    binaries,
    is_built,
    packaged_gguf,
    quantized,
)
from bench.llama_server import llama_server
from bench.machine import loadavg_1m
from bench.output import RESULTS_DIR, log, write_json
from orcapod.bench.multiturn import Endpoint, http_base_url
from orcapod.bench.openai_trace import replay, summarize
from orcapod.bench.run import machine
from orcapod.bench.service import benchmark_redis, orcapod_up
from orcapod.bench.traces import TraceSpec, make_trace

CONTEXT_PER_SLOT = 1024
SETTLE_S = 3.0  # between servers, so the last one's processes have left the cores
# Saturated: orcapod's highest completed req/s over llama-server's best (issue 33's
# target; issue 14 asked 1.2).
TARGET_RATIO = 1.5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="0.5,1,1.5,2,3", help="arrival rates, req/s")
    parser.add_argument("--duration", type=float, default=60.0, help="s of arrivals per rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default="Q4_1,Q8_0", help="llama-server's GGUFs")
    parser.add_argument("--slots", type=int, default=16, help="llama-server -np")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    parser.add_argument("--up-arg", action="append", default=[], help="a flag of `orcapod up`")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "orca_peer.json")
    return parser


def sweep(endpoint: Endpoint, rates: list[float], args: argparse.Namespace) -> list[dict]:
    """One replay per rate against ``endpoint``, in order."""
    runs = []
    for rate in rates:
        trace = make_trace(TraceSpec("orca", rate, seed=args.seed, duration_s=args.duration))
        log(f"{endpoint.name}: {len(trace)} requests at {rate} req/s ...")
        _, records = asyncio.run(replay(endpoint, trace, progress=not args.no_progress))
        runs.append(summarize(records, rate))
    return runs


def saturation(runs: list[dict]) -> float:
    return max((run.get("completed_rps", 0.0) for run in runs), default=0.0)


def table(results: dict[str, list[dict]]) -> str:
    names = list(results)
    header = "| offered req/s | " + " | ".join(
        f"{name}: req/s, tok/s, normalized p50 / p90 s, TTFT p50 s" for name in names
    )
    lines = [header + " |", "|---:|" + "---|" * len(names)]
    rates = [run["offered_rps"] for run in results[names[0]]]
    for index, rate in enumerate(rates):
        cells = []
        for name in names:
            run = results[name][index]
            if not run.get("completed"):
                cells.append("none completed")
                continue
            ttft = run["ttft_p50_s"]
            cells.append(
                f"{run['completed_rps']:.2f}, {run['output_tokens_per_s']:.0f}, "
                f"{run['normalized_latency_p50_s']:.3f} / {run['normalized_latency_p90_s']:.3f}, "
                f"{'–' if ttft is None else f'{ttft:.2f}'}"
                + (f" ({run['completed']}/{run['requests']})"
                   if run["completed"] < run["requests"] else "")
            )  # fmt: skip
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    rates = [float(rate) for rate in args.rates.split(",") if rate.strip()]
    cache_dir = args.cache_dir.expanduser()
    if not is_built(cache_dir):
        raise SystemExit(f"llama.cpp is not built in {cache_dir}: {BUILD_COMMAND}")
    paths = binaries(cache_dir)
    logs = args.out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {"machine": machine(), "settings": {
        "rates": rates, "duration_s": args.duration, "seed": args.seed, "slots": args.slots,
        "threads": args.threads, "formats": args.formats, "up_args": args.up_arg,
    }}  # fmt: skip
    results: dict[str, list[dict]] = {}
    with benchmark_redis() as redis:
        log(f"orcapod up {' '.join(args.up_arg)} ...")
        with orcapod_up(redis.url, "fair", logs / "up.log", args.up_arg) as ws_url:
            results["orcapod"] = sweep(Endpoint("orcapod", http_base_url(ws_url)), rates, args)
    for kind in [kind.strip() for kind in args.formats.split(",") if kind.strip()]:
        time.sleep(SETTLE_S)
        model = quantized(paths, packaged_gguf(), kind, cache_dir)
        name = f"llama-server {kind}"
        log(f"{name} -np {args.slots} -t {args.threads} ...")
        with llama_server(cache_dir, args.threads, args.slots, args.slots * CONTEXT_PER_SLOT,
                          logs / f"llama-server-{kind}.log", model=model) as url:  # fmt: skip
            results[name] = sweep(Endpoint(name, url), rates, args)
    document["machine"]["loadavg_1m_after"] = loadavg_1m()
    document["runs"] = results
    ours = saturation(results["orcapod"])
    peers = {name: saturation(runs) for name, runs in results.items() if name != "orcapod"}
    best = max(peers, key=lambda name: peers[name]) if peers else None
    print()
    print(table(results))
    print()
    for name, value in {"orcapod": ours, **peers}.items():
        print(f"saturation, {name}: {value:.2f} req/s")
    if best is not None and peers[best] > 0:
        ratio = ours / peers[best]
        verdict = "MET" if ratio >= TARGET_RATIO else "MISSED"
        line = (f"{verdict}: orcapod saturates at {ratio:.2f}x {best} "
                f"(target {TARGET_RATIO}x)")  # fmt: skip
        print(line)
        document["verdict"] = line
    write_json(args.out, document, indent=1)
    print(f"\nwrote {args.out} (logs in {logs}/)")


if __name__ == "__main__":
    main()
