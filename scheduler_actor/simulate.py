"""``orcapod simulate``: the three policies on the Orca trace, and a two-tenant run.

Prints throughput and median/p99 normalized latency per policy and arrival
rate, the throughput ratio at equal median latency (Orca's headline, Fig. 10),
and writes ``results.json``, ``fig10.png`` (latency against throughput) and
``tenants.png`` (each tenant's accumulated service under fair and orca).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.cost_model import CostModel
from scheduler_actor.errors import ConfigError
from scheduler_actor.simulation import (
    ClusterSpec,
    TraceRequest,
    orca_trace,
    run_simulation,
    summarize,
)

# The Orca trace's means: prompt ~ U(32, 512), max_tokens ~ U(1, 128).
ORCA_MEAN_PROMPT_TOKENS = 272.0
ORCA_MEAN_OUTPUT_TOKENS = 64.5
AUTO_RATE_SHARES = (0.1, 0.25, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3)
# Long enough that the bounded head start of whoever is served first (VTC's
# guarantee) is small against the service that follows.
TENANT_RUN_REQUESTS = 400


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orcapod simulate", description=__doc__)
    parser.add_argument("--policies", default="request,orca,fair")
    parser.add_argument(
        "--rates",
        default="auto",
        help="arrivals per second, comma-separated; 'auto' sweeps 10%%..130%% of the "
        "saturation rate the cost model predicts",
    )
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", help="a,b,c of step_s = a + b*new + c*attended")
    parser.add_argument("--engine-json", type=Path, help="cost model from bench/engine.py")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-inflight", type=int, default=2)
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="refuse a submit beyond this many waiting requests, as the scheduler's "
        "--max-waiting does (default: no cap)",
    )
    parser.add_argument(
        "--tenant-duration-s",
        type=float,
        default=None,
        help="simulated seconds of the two-tenant run (default: time for about "
        f"{TENANT_RUN_REQUESTS} requests at the saturation rate, at least 60 s)",
    )
    parser.add_argument("--skip-tenants", action="store_true", help="skip the two-tenant run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/simulate"))
    return parser


def _cost_model(args: argparse.Namespace) -> CostModel:
    if args.cost:
        return CostModel.parse(args.cost)
    if args.engine_json:
        return CostModel.from_engine_json(args.engine_json)
    return CostModel()


def _config(args: argparse.Namespace, policy: PolicyName) -> SchedulerConfig:
    return SchedulerConfig(
        policy=policy,
        max_batch_size=args.max_batch_size,
        token_budget=args.token_budget,
        max_chunk_tokens=args.token_budget,
        max_waiting=args.max_waiting,
    )


def throughput_at_latency(rows: list[dict], policy: str, latency_s: float) -> float:
    """Highest throughput (req/s) of ``policy`` whose median normalized
    latency is at most ``latency_s``; 0 when none is."""
    return max(
        (
            row["throughput_rps"]
            for row in rows
            if row["policy"] == policy and row["latency_p50_s_per_token"] <= latency_s
        ),
        default=0.0,
    )


def _headline(rows: list[dict], policies: list[str]) -> list[dict]:
    """Throughput ratios against ``request`` at the latencies ``request`` reached."""
    if "request" not in policies:
        return []
    targets = sorted(row["latency_p50_s_per_token"] for row in rows if row["policy"] == "request")
    headline = []
    for latency_s in targets:
        base = throughput_at_latency(rows, "request", latency_s)
        entry: dict = {"latency_p50_s_per_token": latency_s, "request_rps": base}
        for policy in policies:
            if policy != "request":
                entry[f"{policy}_rps"] = throughput_at_latency(rows, policy, latency_s)
                entry[f"{policy}_ratio"] = entry[f"{policy}_rps"] / base
        headline.append(entry)
    return headline


def _saturation_rps(args: argparse.Namespace, cost_model: CostModel) -> float:
    return cost_model.saturation_rps(
        args.max_batch_size, ORCA_MEAN_PROMPT_TOKENS, ORCA_MEAN_OUTPUT_TOKENS
    )


def _rates(args: argparse.Namespace, cost_model: CostModel) -> list[float]:
    if args.rates != "auto":
        return [float(rate) for rate in args.rates.split(",")]
    saturation = _saturation_rps(args, cost_model)
    return [round(saturation * share, 4) for share in AUTO_RATE_SHARES]


def _tenant_run(
    args: argparse.Namespace, cluster: ClusterSpec, saturation_rps: float
) -> dict[str, list]:
    """Tenant A sends three times as fast as B; together they overload the worker 2x."""
    duration_s = args.tenant_duration_s or max(60.0, TENANT_RUN_REQUESTS / saturation_rps)
    heavy_rps, light_rps = 1.5 * saturation_rps, 0.5 * saturation_rps
    heavy = [
        r for r in orca_trace(100_000, heavy_rps, args.seed + 1, "A") if r.arrival_s < duration_s
    ]
    light = [
        r for r in orca_trace(100_000, light_rps, args.seed + 2, "B") if r.arrival_s < duration_s
    ]
    trace: list[TraceRequest] = sorted(heavy + light, key=lambda r: r.arrival_s)
    curves: dict[str, list] = {}
    for policy in (PolicyName.FAIR, PolicyName.ORCA):
        result = run_simulation(_config(args, policy), trace, cluster, sample_every_s=1.0)
        curves[policy.value] = [
            (t, services) for t, services in result.service_samples if t <= duration_s
        ]
    return curves


def _plot(rows: list[dict], policies: list[str], tenants: dict[str, list], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for policy in policies:
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate_rps"])
        axes.plot(
            [r["throughput_rps"] for r in mine],
            [r["latency_p50_s_per_token"] for r in mine],
            marker="o",
            label=policy,
        )
    axes.set_yscale("log")
    axes.set_xlabel("throughput (requests/s)")
    axes.set_ylabel("median normalized latency (s/token)")
    axes.set_title("Orca trace, simulated (cf. Orca Fig. 10)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "fig10.png", dpi=120)
    plt.close(figure)
    if not tenants:
        return
    figure, all_axes = plt.subplots(1, len(tenants), figsize=(10, 4), sharey=True)
    for axes, (policy, samples) in zip(all_axes, tenants.items(), strict=True):
        for tenant in ("A", "B"):
            axes.plot(
                [t for t, _ in samples], [s.get(tenant, 0.0) for _, s in samples], label=tenant
            )
        axes.set_title(f"{policy}: A sends 3x as fast as B")
        axes.set_xlabel("time (s)")
        axes.legend()
    all_axes[0].set_ylabel("accumulated service (weighted tokens)")
    figure.tight_layout()
    figure.savefig(out / "tenants.png", dpi=120)
    plt.close(figure)


def main(argv: list[str]) -> int:
    """Run the simulation; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        cost_model = _cost_model(args)
        policies = [PolicyName(name).value for name in args.policies.split(",")]
        rates = _rates(args, cost_model)
        if args.max_waiting is not None and args.max_waiting < 1:
            raise ConfigError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    except (ConfigError, ValueError) as error:
        print(f"orcapod simulate: {error}")
        return 2
    cluster = ClusterSpec(1, args.num_blocks, args.block_size, args.max_inflight, cost_model)
    started_s = time.perf_counter()
    rows = []
    print(
        f"{'policy':<8} {'rate':>6} {'req/s':>7} {'tok/s':>8} {'p50 s/tok':>10} "
        f"{'p99 s/tok':>10} {'refused':>7}"
    )
    for policy in policies:
        config = _config(args, PolicyName(policy))
        for rate in rates:
            trace = orca_trace(args.num_requests, rate, args.seed)
            row = {"policy": policy, "rate_rps": rate}
            row.update(summarize(run_simulation(config, trace, cluster)))
            rows.append(row)
            print(
                f"{policy:<8} {rate:>6.2f} {row['throughput_rps']:>7.2f} "
                f"{row['throughput_tps']:>8.1f} {row['latency_p50_s_per_token']:>10.4f} "
                f"{row['latency_p99_s_per_token']:>10.4f} {row['num_refused']:>7}"
            )
    headline = _headline(rows, policies)
    mean_context = ORCA_MEAN_PROMPT_TOKENS + ORCA_MEAN_OUTPUT_TOKENS / 2
    target_s = cost_model.latency_target_s_per_token(args.max_batch_size, mean_context)
    at_target = {policy: throughput_at_latency(rows, policy, target_s) for policy in policies}
    print(
        f"at Orca's latency target ({target_s:.4f} s/token = 2 x a decode step of batch "
        f"{args.max_batch_size}): "
        + ", ".join(f"{policy} {rps:.2f} req/s" for policy, rps in at_target.items())
    )
    if at_target.get("request"):
        for policy in policies:
            if policy != "request":
                print(f"  {policy} / request = {at_target[policy] / at_target['request']:.1f}x")
    for entry in headline:
        ratios = ", ".join(
            f"{key[:-6]} {value:.1f}x" for key, value in entry.items() if key.endswith("_ratio")
        )
        print(f"at median latency <= {entry['latency_p50_s_per_token']:.4f} s/token: {ratios}")
    tenants = (
        {} if args.skip_tenants else _tenant_run(args, cluster, _saturation_rps(args, cost_model))
    )
    for policy, samples in tenants.items():
        final = samples[-1][1]
        print(
            f"two tenants, {policy}: service A {final.get('A', 0):.0f}, B {final.get('B', 0):.0f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "cost_model": vars(cost_model),
        "cluster": {"num_blocks": args.num_blocks, "block_size": args.block_size},
        "rows": rows,
        "headline": headline,
        "latency_target_s_per_token": target_s,
        "throughput_at_latency_target_rps": at_target,
        "tenants": tenants,
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    _plot(rows, policies, tenants, args.out)
    print(
        f"wrote {args.out}/results.json, fig10.png, tenants.png "
        f"in {time.perf_counter() - started_s:.1f} s"
    )
    return 0
