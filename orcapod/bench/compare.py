"""``orcapod bench compare``: Orca's Fig. 10 on the live service, and the targets.

Starts a private redis-server, then ``orcapod up`` under each policy in turn
(same model, same machine, same seeded Orca trace at the same rates), runs the
rate sweep against it, and writes ``compare.json``, ``fig10.png`` (median
normalized latency, log scale, against throughput; one curve per policy) and
a verdict per target. A last service (``fair`` with small prefill chunks)
runs the short-chat trace alone and then mixed with long prompts, to see
whether chunked prefill keeps the chats' inter-token latency.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from orcapod.bench.loadgen import LoadSettings
from orcapod.bench.run import StatsReader, SweepSettings, add_load_arguments, machine, run_sweep
from orcapod.bench.service import benchmark_redis, orcapod_up
from orcapod.bench.targets import EngineReference, verdicts
from shared.settings import POLICIES

# This 2-core CPU saturates near 0.15-0.2 req/s on the Orca trace (SmolLM2-135M fp32).
DEFAULT_RATES = (0.06, 0.12, 0.2, 0.3, 0.45, 0.6)
QUICK_RATES = (0.3,)
MIXED_SHORT_RATE, MIXED_RATE = 0.15, 0.3  # mixed: half its arrivals are short chats


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orcapod bench compare", description=__doc__)
    parser.add_argument("--policies", default="request,orca,fair")
    parser.add_argument("--model", help="HF-format model dir (default: embedded SmolLM2)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--engine-json", type=Path, default=Path("bench/results/engine.json"))
    parser.add_argument("--latency-target-s", type=float, help="override the paper's target")
    parser.add_argument("--mixed-token-budget", type=int, default=32)
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument(
        "--merge", type=Path, help="a previous compare.json whose runs join these (more rates)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/compare"))
    add_load_arguments(parser)
    return parser


def _up_args(args: argparse.Namespace, *scheduler_args: str) -> list[str]:
    up_args = [
        f"--worker-arg=--kv-cache-bytes={args.kv_cache_bytes}",
        f"--scheduler-arg=--max-batch-size={args.max_batch_size}",
        *(f"--scheduler-arg={flag}" for flag in scheduler_args),
    ]
    if args.model:
        up_args += ["--model", args.model]
    return up_args


def _plot(runs: list[dict], target_s: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4.2))
    for policy in dict.fromkeys(run["policy"] for run in runs):
        points = [
            (run["client"]["throughput_rps"], run["client"]["normalized_latency_s"]["p50"])
            for run in runs
            if run["policy"] == policy and run["client"]["normalized_latency_s"]["p50"]
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o", label=policy)
    if target_s is not None:
        axes.axhline(target_s, color="grey", linestyle="--", label=f"target {target_s:.2f} s")
    axes.set_yscale("log")
    axes.set_xlabel("throughput (completed req/s)")
    axes.set_ylabel("median normalized latency (s/token)")
    axes.set_title("Orca trace on the live service (cf. Orca Fig. 10)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``orcapod bench compare``."""
    args = _parser().parse_args(argv)
    policies = [policy.strip() for policy in args.policies.split(",") if policy.strip()]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        print(f"orcapod bench compare: unknown policies {sorted(unknown)}")
        return 2
    rates = args.rates or (QUICK_RATES if args.quick else DEFAULT_RATES)
    duration_s = args.duration or (15.0 if args.quick else 60.0)
    drain_s = args.drain_timeout or (20.0 if args.quick else 45.0)
    sweep = SweepSettings("orca", tuple(rates), duration_s, args.requests, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    document: dict = {"machine": machine(), "settings": vars(args) | {"rates": rates}}
    document["settings"] = {key: str(value) for key, value in document["settings"].items()}
    runs: list[dict] = []
    mixed_runs: list[dict] = []
    with benchmark_redis() as redis:
        stats = StatsReader(redis.url, "orcapod")
        for policy in policies:
            log = args.out / f"up-{policy}.log"
            with orcapod_up(redis.url, policy, log, _up_args(args)) as url:
                load = LoadSettings(
                    url, args.max_sockets, drain_timeout_s=drain_s, seed=args.seed,
                    progress=not args.no_progress,
                )  # fmt: skip
                runs += run_sweep(sweep, load, stats, policy)
        if not args.skip_mixed and not args.quick:
            budget = str(args.mixed_token_budget)
            chunked = _up_args(args, f"--token-budget={budget}", f"--max-chunk-tokens={budget}")
            with orcapod_up(redis.url, "fair", args.out / "up-mixed.log", chunked) as url:
                load = LoadSettings(
                    url, args.max_sockets, drain_timeout_s=drain_s, seed=args.seed,
                    progress=not args.no_progress,
                )  # fmt: skip
                for trace, rate in (("short", MIXED_SHORT_RATE), ("mixed", MIXED_RATE)):
                    mixed_sweep = SweepSettings(trace, (rate,), duration_s, args.requests)
                    mixed_runs += run_sweep(mixed_sweep, load, stats, "fair")
        stats.close()
    if args.merge:
        previous = json.loads(args.merge.read_text())
        runs = sorted(previous["runs"] + runs, key=lambda run: (run["policy"], run["rate_rps"]))
        mixed_runs = mixed_runs or previous.get("mixed_runs", [])
    reference = EngineReference.load(args.engine_json, args.max_batch_size)
    target_s = args.latency_target_s or (reference.latency_target_s if reference else None)
    document |= {"runs": runs, "mixed_runs": mixed_runs, "engine_reference": reference}
    document["verdicts"] = verdicts(runs, mixed_runs, target_s, reference)
    document["latency_target_s"] = target_s
    _plot(runs, target_s, args.out / "fig10.png")
    (args.out / "compare.json").write_text(json.dumps(document, indent=1, default=vars))
    from orcapod.bench.metrics import table

    print()
    print(table(runs + mixed_runs))
    print()
    for line in document["verdicts"]:
        print(line)
    print(f"\nwrote {args.out / 'compare.json'} and {args.out / 'fig10.png'}")
    return 0
