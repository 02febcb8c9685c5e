"""The Orca trace (no shared prefixes) with the prefix cache on and off, side by side.

Its prompts are random token ids, so nothing is ever hit: what this measures
is what caching costs a service that gains nothing from it (hashing, the
ledger's bookkeeping, cached blocks evicted to make room). One run: a
private redis-server, then ``orcapod up`` (``fair``) with the cache, then
without, each at the same seeded rates; alternated ``--rounds`` times, since
this machine's speed drifts between minutes.

    python bench/prefix_cache_orca.py --rates 0.15,0.3 --duration 120 --rounds 2

Prints one table and writes ``bench/results/prefix_cache_orca.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orcapod.bench.loadgen import LoadSettings
from orcapod.bench.metrics import table
from orcapod.bench.run import (
    StatsReader,
    SweepSettings,
    machine,
    parse_rates,
    run_sweep,
)
from orcapod.bench.service import benchmark_redis, flush, orcapod_up

VARIANTS = {"cache on": (), "cache off": ("--scheduler-arg=--no-prefix-cache",)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=parse_rates, default=(0.15, 0.3))
    parser.add_argument("--duration", type=float, default=120.0, help="seconds per rate")
    parser.add_argument("--rounds", type=int, default=2, help="on, off, on, off...")
    parser.add_argument("--kv-cache-bytes", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--max-sockets", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefix_cache_orca.json"))
    args = parser.parse_args()
    sweep = SweepSettings("orca", tuple(args.rates), args.duration, None)
    runs: list[dict] = []
    logs = args.out.parent / "prefix_cache_orca"
    with benchmark_redis() as redis:
        stats = StatsReader(redis.url, "orcapod")
        for round_index in range(args.rounds):
            for label, flags in VARIANTS.items():
                flush(redis.url)
                up_args = [f"--worker-arg=--kv-cache-bytes={args.kv_cache_bytes}", *flags]
                log = logs / f"up-{label.replace(' ', '-')}-{round_index}.log"
                with orcapod_up(redis.url, "fair", log, up_args) as url:
                    load = LoadSettings(url, args.max_sockets, drain_timeout_s=180.0)
                    for run in run_sweep(sweep, load, stats, f"fair, {label}"):
                        runs.append(run | {"round": round_index, "variant": label})
        stats.close()
    document = {"machine": machine(), "settings": vars(args), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1, default=str))
    print()
    print(table(runs))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
