"""A worker group's pipeline on the Orca trace, side by side in one run: each
stage's busy fraction with plans in every stage (Orca's Figure 8) against
the same group fed one plan at a time, and the throughput of the
group against one engine and against llama.cpp's ``llama-server``.

    python -m bench.pipeline [--stages 2] [--rates 2,3] [--duration 40]
                             [--servers one,group,per-stage,one-at-a-time,big-plans]
                             [--layer-splits 16,14/17,13]
                             [--formats Q4_1,Q8_0] [--slots 16] [--threads 2]
                             [--cache-dir ~/.cache/orcapod/llama.cpp]
                             [--out bench/results/pipeline.json]

The same seeded Orca trace (``bench/orca_peer.py``'s: Poisson arrivals,
prompts of U(32, 512) tokens, U(1, 128) greedy answers) is replayed open
loop over the OpenAI API, one server at a time:

1. ``orcapod up`` as it comes (one engine, torch's threads on every core);
2. ``orcapod up --pipeline-parallel P`` as it comes: P stages of the model's
   layers, one process each, torch's threads divided between them (one each
   on 2 cores), P + 1 plans in flight, each of at most the scheduler's
   ``--pipeline-token-budget`` new tokens;
3. the same group with ``--max-inflight P``: one plan per stage;
4. the same group with ``--max-inflight 1``: one plan at a time, so a stage
   waits while the others compute (the bubble microbatch-free scheduling
   removes; about 1/P busy each);
5. the same group with plans of one engine's size (``--pipeline-token-budget
   512``: whole prompt chunks beside decodes);
6. the same group with each ``--layer-split`` of ``--layer-splits`` (none by
   default): the last stage also runs the LM head and samples;
7. ``llama-server -np --slots`` on each GGUF of ``--formats``.

``--servers`` picks which of 1-5 run (all by default).

The groups' busy fractions come from their first stage's ``pipeline_summary``
lines (each stage's compute time over the wall time of 200 steps), the
median of those logged during each rate's replay. Saturation throughput is
the highest completed requests/s over the rates. Prints the tables, writes
JSON. Never run by the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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
from bench.orca_peer import CONTEXT_PER_SLOT, SETTLE_S, saturation, table
from bench.output import RESULTS_DIR, log, write_json
from orcapod.bench.multiturn import Endpoint, http_base_url
from orcapod.bench.openai_trace import replay, summarize
from orcapod.bench.run import machine
from orcapod.bench.service import benchmark_redis, orcapod_up
from orcapod.bench.traces import TraceSpec, make_trace

# Each stage busy at saturation with one plan per stage in flight (issue 32).
TARGET_BUSY = 0.9
# The orcapod servers of a run, by the name ``--servers`` takes.
SERVER_KEYS = ("one", "group", "per-stage", "one-at-a-time", "big-plans")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2, help="the group's --pipeline-parallel")
    parser.add_argument("--rates", default="2,3", help="arrival rates, req/s")
    parser.add_argument("--duration", type=float, default=40.0, help="s of arrivals per rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default="Q4_1,Q8_0", help="llama-server's GGUFs ('' none)")
    parser.add_argument("--slots", type=int, default=16, help="llama-server -np")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument(
        "--servers", default=",".join(SERVER_KEYS),
        help=f"which orcapod servers to run, of {','.join(SERVER_KEYS)}",
    )  # fmt: skip
    parser.add_argument(
        "--layer-splits", default="",
        help="more groups, one for each --layer-split, separated by '/' (e.g. 16,14/17,13)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "pipeline.json")
    return parser


def stage_busy(log_path: Path, start: int) -> list[float] | None:
    """The median busy fraction of each stage over the ``pipeline_summary`` lines
    written to ``log_path`` past byte ``start`` (None: none yet)."""
    summaries = []
    with log_path.open("rb") as log_file:
        log_file.seek(start)
        for line in log_file:
            if b'"pipeline_summary"' not in line:
                continue
            try:
                summaries.append(json.loads(line)["stage_busy_fraction"])
            except (ValueError, KeyError):
                continue
    if not summaries:
        return None
    return [round(statistics.median(column), 3) for column in zip(*summaries, strict=True)]


def sweep(
    endpoint: Endpoint, rates: list[float], args: argparse.Namespace, log_path: Path | None
) -> list[dict]:
    """One replay per rate; each run with its stages' busy fractions where
    ``log_path`` is a group's log."""
    runs = []
    for rate in rates:
        trace = make_trace(TraceSpec("orca", rate, seed=args.seed, duration_s=args.duration))
        log(f"{endpoint.name}: {len(trace)} requests at {rate} req/s ...")
        start = log_path.stat().st_size if log_path is not None else 0
        _, records = asyncio.run(replay(endpoint, trace, progress=not args.no_progress))
        run = summarize(records, rate)
        if log_path is not None:
            run["stage_busy_fraction"] = stage_busy(log_path, start)
        runs.append(run)
    return runs


def busy_table(results: dict[str, list[dict]]) -> str:
    lines = ["| server | offered req/s | each stage's busy fraction |", "|---|---:|---|"]
    for name, runs in results.items():
        for run in runs:
            busy = run.get("stage_busy_fraction")
            if busy is not None:
                cells = ", ".join(f"{value:.2f}" for value in busy)
                lines.append(f"| {name} | {run['offered_rps']:g} | {cells} |")
    return "\n".join(lines)


def orcapod_servers(args: argparse.Namespace) -> dict[str, list[str]]:
    """The orcapod servers ``--servers`` and ``--layer-splits`` ask for: name -> the
    flags of ``orcapod up``."""
    stages = str(args.stages)
    group = ["--pipeline-parallel", stages]
    every = {
        "one": ("orcapod, one engine", []),
        # The group as it comes: one plan more than stages in flight (the next one is
        # there while the scheduler's round trip for the last result runs), each at
        # most --pipeline-token-budget new tokens.
        "group": (f"orcapod, {stages} stages", group),
        "per-stage": (
            f"orcapod, {stages} stages, one plan per stage",
            [*group, f"--worker-arg=--max-inflight={stages}"],
        ),
        "one-at-a-time": (
            f"orcapod, {stages} stages, one plan at a time",
            [*group, "--worker-arg=--max-inflight=1"],
        ),
        # Plans as one engine's (up to --token-budget, whole prompt chunks): a long
        # chunk among decodes keeps the other stage waiting.
        "big-plans": (
            f"orcapod, {stages} stages, plans of one engine's size",
            [*group, "--scheduler-arg=--pipeline-token-budget=512"],
        ),
    }
    keys = [key.strip() for key in args.servers.split(",") if key.strip()]
    unknown = sorted(set(keys) - set(every))
    if unknown:
        raise SystemExit(f"--servers: {unknown} are not of {','.join(SERVER_KEYS)}")
    servers = dict(every[key] for key in SERVER_KEYS if key in keys)
    # The last stage also runs the LM head and samples: a split by cost, not count.
    for split in (part.strip() for part in args.layer_splits.split("/")):
        if split:
            name = f"orcapod, {stages} stages, --layer-split {split}"
            servers[name] = [*group, f"--worker-arg=--layer-split={split}"]
    return servers


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    rates = [float(rate) for rate in args.rates.split(",") if rate.strip()]
    formats = [kind.strip() for kind in args.formats.split(",") if kind.strip()]
    cache_dir = args.cache_dir.expanduser()
    if formats and not is_built(cache_dir):
        raise SystemExit(f"llama.cpp is not built in {cache_dir}: {BUILD_COMMAND}")
    logs = args.out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {"machine": machine(), "settings": {
        "stages": args.stages, "rates": rates, "duration_s": args.duration, "seed": args.seed,
        "slots": args.slots, "threads": args.threads, "formats": formats,
    }}  # fmt: skip
    services = orcapod_servers(args)
    results: dict[str, list[dict]] = {}
    for index, (name, up_args) in enumerate(services.items()):
        log_path = logs / f"up-{index}.log"
        with benchmark_redis() as redis:
            log(f"orcapod up {' '.join(up_args)} ...")
            with orcapod_up(redis.url, "fair", log_path, up_args) as ws_url:
                endpoint = Endpoint(name, http_base_url(ws_url))
                results[name] = sweep(endpoint, rates, args, log_path)
        time.sleep(SETTLE_S)
    for kind in formats:
        paths = binaries(cache_dir)
        model = quantized(paths, packaged_gguf(), kind, cache_dir)
        name = f"llama-server {kind}"
        log(f"{name} -np {args.slots} -t {args.threads} ...")
        with llama_server(cache_dir, args.threads, args.slots, args.slots * CONTEXT_PER_SLOT,
                          logs / f"llama-server-{kind}.log", model=model) as url:  # fmt: skip
            results[name] = sweep(Endpoint(name, url), rates, args, None)
        time.sleep(SETTLE_S)
    document["machine"]["loadavg_1m_after"] = loadavg_1m()
    document["runs"] = results
    print()
    print(table(results))
    print()
    print(busy_table(results))
    print()
    saturated = {name: saturation(runs) for name, runs in results.items()}
    for name, value in saturated.items():
        print(f"saturation, {name}: {value:.2f} req/s")
    group = results.get(f"orcapod, {args.stages} stages")
    if group:
        busiest_rate = max(group, key=lambda run: run.get("completed_rps", 0.0))
        busy = busiest_rate.get("stage_busy_fraction") or []
        verdict = "MET" if busy and min(busy) >= TARGET_BUSY else "MISSED"
        line = f"{verdict}: each stage busy {busy} at saturation (target >= {TARGET_BUSY})"
        print(line)
        document["verdict"] = line
    write_json(args.out, document, indent=1)
    print(f"\nwrote {args.out} (logs in {logs}/)")


if __name__ == "__main__":
    main()
