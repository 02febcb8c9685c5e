"""orcapod's prefix cache on the multi-turn trace, beside llama.cpp's server, in one run.

    python -m bench.multiturn [--conversations 4] [--turns 8] [--max-tokens 24] [--seed 0]
                              [--runs cache,no-cache,routing,no-routing,llama-server]
                              [--up-arg=--scheduler-arg=--routing-slack=2 ...]
                              [--llama-cache-dir ~/.cache/orcapod/llama.cpp]
                              [--llama-threads 1] [--llama-slots N]
                              [--orca-duration 0] [--orca-rate 0.1]
                              [--out bench/results/multiturn.json]

One server at a time on this machine, the same seeded trace for each
(``orcapod.bench.multiturn``: C conversations at once sharing a ~440-token
system prompt, each turn the history plus the answer plus a new user message,
sent once the previous answer is back; temperature 0, ``--max-tokens`` each):

- ``cache``: ``orcapod up --workers 1`` (the prefix cache is on by default);
- ``no-cache``: the same with ``--scheduler-arg=--no-prefix-cache``;
- ``routing``: ``--workers 2``, cache-aware routing (the default);
- ``no-routing``: ``--workers 2 --scheduler-arg=--no-cache-routing``: its hit
  rate beside ``routing``'s is what routing by cached prefix adds;
- ``llama-server``: llama.cpp's server, the build ``bench/llama_cpp.py`` makes
  in ``--llama-cache-dir``, on the packaged Q4_1 GGUF of the embedded model,
  ``-np`` slots (one per conversation by default, so each keeps its prompt),
  ``"cache_prompt": true`` in every request; skipped, with a note, without
  the build.

Each orcapod runs on the benchmark's own redis-server (flushed between
services; ``orcapod.bench.service``), which also gives the scheduler's
``prefix_cache`` counters over the run (the "service hit rate"). The two
workers of ``routing`` and ``no-routing`` get one thread each
(``OMP_NUM_THREADS=1``): two workers of two threads on a 2-core machine would
measure contention, not routing. With ``--orca-duration`` > 0, ``cache`` and
``no-cache`` also run the Orca trace (no shared prefixes) at ``--orca-rate``
for that long, for the target that the cache leaves its throughput unchanged.

Prints one table per turn index (TTFT p50 and prefill tokens computed p50 of
every run), one row per run (hit rates, turns/s, output tok/s, TTFT of the
last turn over the first), and PASS/MISS lines for the targets; writes JSON
with every turn's record to ``--out`` (logs beside it). The defaults take
about 10 minutes on 2 cores. Never run by the test suite.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.llama_cpp_build import BUILD_COMMAND, binaries
from bench.llama_server import add_llama_arguments, llama_server
from bench.machine import loadavg_1m
from bench.output import RESULTS_DIR, log, write_json
from orcapod.bench.loadgen import LoadSettings
from orcapod.bench.metrics import table as orca_table
from orcapod.bench.multiturn import (
    Endpoint,
    http_base_url,
    measure,
)
from orcapod.bench.multiturn_report import (
    overview_table,
    turn_table,
    verdicts,
)
from orcapod.bench.multiturn_trace import (
    MultiturnSpec,
    make_multiturn_trace,
)
from orcapod.bench.run import StatsReader, SweepSettings, machine, run_sweep
from orcapod.bench.service import benchmark_redis, orcapod_up

LLAMA_CONTEXT_PER_SLOT = 2048  # the history of 8 turns is ~900 tokens
LLAMA_READY_TIMEOUT_S = 120.0
SETTLE_S = 3.0  # between services, so the last one's processes have left the cores


@dataclass(frozen=True)
class OrcapodRun:
    """One ``orcapod up`` configuration of the comparison."""

    name: str
    num_workers: int
    scheduler_args: tuple[str, ...] = ()

    def up_args(self, extra: list[str]) -> list[str]:
        flags = [f"--scheduler-arg={flag}" for flag in self.scheduler_args]
        return ["--workers", str(self.num_workers), *flags, *extra]

    def environment(self) -> dict[str, str]:
        cores = os.cpu_count() or 1
        threads = max(1, cores // self.num_workers)
        return {} if self.num_workers == 1 else {"OMP_NUM_THREADS": str(threads)}


ORCAPOD_RUNS = {
    run.name: run
    for run in (
        OrcapodRun("cache", 1),
        OrcapodRun("no-cache", 1, ("--no-prefix-cache",)),
        OrcapodRun("routing", 2),
        OrcapodRun("no-routing", 2, ("--no-cache-routing",)),
    )
}
LLAMA_SERVER = "llama-server"
ORCA_RUNS = ("cache", "no-cache")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=4, help="run at once")
    parser.add_argument("--turns", type=int, default=8, help="per conversation")
    parser.add_argument("--max-tokens", type=int, default=24, help="per answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--runs",
        default=",".join([*ORCAPOD_RUNS, LLAMA_SERVER]),
        help="which of them, in this order, comma separated",
    )
    parser.add_argument(
        "--up-arg", action="append", default=[], help="an extra flag of every `orcapod up`"
    )
    add_llama_arguments(parser)
    parser.add_argument(
        "--llama-slots", type=int, help="llama-server -np (default: one per conversation)"
    )
    parser.add_argument("--orca-duration", type=float, default=0.0, help="s of Orca-trace arrivals")
    parser.add_argument("--orca-rate", type=float, default=0.1, help="Orca-trace arrivals, req/s")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "multiturn.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    names = [name.strip() for name in args.runs.split(",") if name.strip()]
    unknown = set(names) - {*ORCAPOD_RUNS, LLAMA_SERVER}
    if unknown:
        raise SystemExit(
            f"unknown runs {sorted(unknown)}; choose from {[*ORCAPOD_RUNS, LLAMA_SERVER]}"
        )
    spec = MultiturnSpec(args.conversations, args.turns, args.max_tokens, args.seed)
    trace = make_multiturn_trace(spec)
    progress = not args.no_progress
    logs = args.out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    llama_cache_dir = args.llama_cache_dir.expanduser()
    document: dict[str, Any] = {
        "machine": machine(),
        "settings": {
            **asdict(spec),
            "runs": names,
            "up_args": args.up_arg,
            "llama_threads": args.llama_threads,
            "orca_rate_rps": args.orca_rate,
            "orca_duration_s": args.orca_duration,
        },
        "skipped": {},
    }
    summaries: dict[str, dict[str, Any]] = {}
    orca_runs: list[dict] = []
    with benchmark_redis() as redis:
        for name in (name for name in names if name in ORCAPOD_RUNS):
            run = ORCAPOD_RUNS[name]
            up_args = run.up_args(args.up_arg)
            log(f"{name}: orcapod up {' '.join(up_args)} ...")
            with orcapod_up(
                redis.url, "fair", logs / f"up-{name}.log", up_args, run.environment()
            ) as ws_url:
                endpoint = Endpoint(f"orcapod {name}", http_base_url(ws_url))
                summary = measure(endpoint, trace, redis.url, progress=progress)
                summaries[name] = summary | {"up_args": up_args, "environment": run.environment()}
                if name in ORCA_RUNS and args.orca_duration > 0:
                    sweep = SweepSettings("orca", (args.orca_rate,), args.orca_duration, None,
                                          args.seed)  # fmt: skip
                    load = LoadSettings(ws_url, drain_timeout_s=60.0, seed=args.seed,
                                        progress=progress)  # fmt: skip
                    stats = StatsReader(redis.url, "orcapod")
                    try:
                        orca_runs += run_sweep(sweep, load, stats, policy=f"fair, {name}")
                    finally:
                        stats.close()
            time.sleep(SETTLE_S)
    if LLAMA_SERVER in names:
        if not binaries(llama_cache_dir)["llama-server"].exists():
            note = f"no llama-server in {llama_cache_dir} ({BUILD_COMMAND})"
            log(f"skipping llama-server: {note}")
            document["skipped"][LLAMA_SERVER] = note
        else:
            slots = args.llama_slots or spec.num_conversations
            log(f"llama-server -np {slots} -t {args.llama_threads} ...")
            with llama_server(
                llama_cache_dir,
                args.llama_threads,
                slots,
                slots * LLAMA_CONTEXT_PER_SLOT,
                logs / "llama-server.log",
                ready_timeout_s=LLAMA_READY_TIMEOUT_S,
            ) as url:
                endpoint = Endpoint(LLAMA_SERVER, url, extra_body={"cache_prompt": True})
                summaries[LLAMA_SERVER] = measure(endpoint, trace, progress=progress) | {
                    "slots": slots, "threads": args.llama_threads,
                }  # fmt: skip
    document["machine"]["loadavg_1m_after"] = loadavg_1m()
    document["runs"] = summaries
    document["orca_runs"] = orca_runs
    lines = []
    if "cache" in summaries:
        lines = verdicts(
            summaries["cache"], summaries.get("no-cache"),
            summaries.get("routing"), summaries.get("no-routing"),
        )  # fmt: skip
    document["verdicts"] = lines
    print()
    print(turn_table(summaries))
    print()
    print(overview_table(summaries))
    if orca_runs:
        print()
        print(orca_table(orca_runs))
    if lines:
        print()
        print("\n".join(lines))
    write_json(args.out, document, indent=1)
    print(f"\nwrote {args.out} (logs in {logs}/)")


if __name__ == "__main__":
    main()
