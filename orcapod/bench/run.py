"""``orcapod bench``: sweep arrival rates of one trace against a running orcapod.

Speaks only the public websocket protocol (``--url``). With ``--redis-url``
it also reads the workers' stats hash before and after each run, for the
service-side figures (busy fraction, batch size, tokens per step, gap between
steps). Prints a markdown table and writes every run as JSON.

``--trace multiturn`` is closed loop instead (``orcapod.bench.multiturn``):
``--conversations`` × ``--turns`` chat turns over the same gateway's OpenAI
API, then the same trace against ``--peer-url`` (another OpenAI-compatible
server, e.g. llama.cpp's ``llama-server``); a table per turn index of TTFT and
prefill tokens computed, side by side, and with ``--redis-url`` the
scheduler's prefix-cache counters over the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from orcapod.bench.loadgen import LoadError, LoadSettings, run_trace
from orcapod.bench.metrics import (
    parse_stats,
    summarize_by_kind,
    summarize_requests,
    summarize_service,
    table,
    table_row,
)
from orcapod.bench.multiturn import (
    Endpoint,
    check_http_loopback,
    http_base_url,
    measure,
)
from orcapod.bench.multiturn_report import (
    overview_table,
    turn_table,
)
from orcapod.bench.multiturn_trace import (
    MultiturnSpec,
    make_multiturn_trace,
)
from orcapod.bench.traces import TRACES, TraceSpec, make_trace
from shared.keys import RedisKeys
from shared.settings import client_api_key

QUICK_RATES, QUICK_DURATION_S, QUICK_DRAIN_S = "0.3", 20.0, 30.0
MULTITURN = "multiturn"  # closed loop: not one of the open-loop TRACES
DEFAULT_MAX_TOKENS, MULTITURN_MAX_TOKENS = 64, 32
LLAMA_SERVER_EXTRA_BODY = '{"cache_prompt": true}'  # llama-server: reuse the slot's prompt
SETTLE_S = 2.0  # between runs, so cancelled work has left the engine


@dataclass(frozen=True)
class SweepSettings:
    """One trace at several rates, each run bounded by duration or request count."""

    trace: str
    rates_rps: tuple[float, ...]
    duration_s: float | None
    num_requests: int | None
    seed: int = 0
    prompt_len: int = 256
    max_tokens: int = 64


class StatsReader:
    """Snapshots of the workers' stats hash (only with --redis-url)."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self._redis = redis.Redis.from_url(redis_url)
        self._key = RedisKeys(prefix).stats

    def snapshot(self) -> tuple[dict[str, float], int]:
        """(counters summed over workers, number of workers seen)."""
        raw: dict[bytes, bytes] = self._redis.hgetall(self._key)  # type: ignore[assignment]
        workers = {key.decode().partition(":")[0] for key in raw}
        return parse_stats(raw), max(1, len(workers))

    def close(self) -> None:
        self._redis.close()


def run_sweep(
    sweep: SweepSettings,
    load: LoadSettings,
    stats: StatsReader | None = None,
    policy: str | None = None,
) -> list[dict]:
    """Run the trace at each rate; one result dict per rate (also printed as a row)."""
    runs = []
    for rate_rps in sweep.rates_rps:
        spec = TraceSpec(
            sweep.trace,
            rate_rps,
            seed=sweep.seed,
            num_requests=sweep.num_requests,
            duration_s=sweep.duration_s,
            prompt_len=sweep.prompt_len,
            max_tokens=sweep.max_tokens,
        )
        trace = make_trace(spec)
        before = stats.snapshot() if stats else None
        started_s = time.monotonic()
        result = run_trace(load, trace, f"{policy or sweep.trace} @ {rate_rps}/s")
        stats_wall_s = time.monotonic() - started_s
        service = None
        if stats is not None and before is not None:
            after, num_workers = stats.snapshot()
            # The stats window covers the whole run, including the drain.
            service = summarize_service(before[0], after, stats_wall_s, num_workers)
        run = {
            "trace": sweep.trace,
            "policy": policy,
            "rate_rps": rate_rps,
            "num_sockets": result.num_sockets,
            "num_late_sends": result.num_late_sends,
            "client": summarize_requests(result.records, result.wall_s),
            "by_kind": summarize_by_kind(result.records, result.wall_s),
            "service": service,
            "loadavg_1m_after": round(os.getloadavg()[0], 2),  # other work on the machine
        }
        runs.append(run)
        print(table_row(run), flush=True)
        time.sleep(SETTLE_S)
    return runs


def machine() -> dict:
    """What ran the benchmark (for the JSON and the docs)."""
    import torch  # only for its version; the load generator never runs a model

    load1, load5, _ = os.getloadavg()
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg_1m_5m_at_start": [round(load1, 2), round(load5, 2)],
    }


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.1,0.5,1' -> (0.1, 0.5, 1.0)."""
    rates = tuple(float(part) for part in text.split(",") if part.strip())
    if not rates or any(rate <= 0 for rate in rates):
        raise argparse.ArgumentTypeError("rates must be positive numbers separated by commas")
    return rates


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``orcapod bench`` and ``orcapod bench compare``."""
    parser.add_argument("--rates", type=parse_rates, help="arrival rates (req/s), comma separated")
    parser.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    parser.add_argument("--requests", type=int, help="requests per rate (first bound wins)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drain-timeout", type=float, help="seconds to wait after arrivals")
    parser.add_argument("--max-sockets", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (~2 minutes)")
    parser.add_argument("--no-progress", action="store_true")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orcapod bench", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/ws", help="a gateway (loopback)")
    parser.add_argument("--api-key", help="sent as a Bearer token (default: $ORCAPOD_API_KEY)")
    parser.add_argument("--trace", choices=(*TRACES, MULTITURN), default="orca")
    parser.add_argument("--prompt-len", type=int, default=256, help="homogeneous trace")
    parser.add_argument(
        "--max-tokens",
        type=int,
        help=f"homogeneous/chat traces (default {DEFAULT_MAX_TOKENS}), "
        f"multiturn (default {MULTITURN_MAX_TOKENS})",
    )
    parser.add_argument("--redis-url", help="read the workers' stats hash here (optional)")
    parser.add_argument("--prefix", default="orcapod", help="Redis key prefix")
    parser.add_argument("--policy", help="label for the results (what the service runs)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench.json"))
    add_load_arguments(parser)
    multiturn = parser.add_argument_group("--trace multiturn")
    multiturn.add_argument("--conversations", type=int, default=8, help="run at once")
    multiturn.add_argument("--turns", type=int, default=8, help="per conversation")
    multiturn.add_argument(
        "--peer-url", help="another OpenAI-compatible server, http://127.0.0.1:PORT, run after"
    )
    multiturn.add_argument("--peer-api-key")
    multiturn.add_argument("--peer-name", default="peer", help="its name in the table")
    multiturn.add_argument(
        "--peer-extra-body",
        type=json.loads,
        default=LLAMA_SERVER_EXTRA_BODY,
        help=f"JSON joined to every request to the peer (default {LLAMA_SERVER_EXTRA_BODY})",
    )
    return parser


def run_multiturn(args: argparse.Namespace) -> int:
    """``--trace multiturn``: orcapod at ``--url``, then the peer, on the same trace."""
    max_tokens = MULTITURN_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    spec = MultiturnSpec(args.conversations, args.turns, max_tokens, args.seed)
    if args.peer_url:
        check_http_loopback(args.peer_url)  # before orcapod's run, not after it
    trace = make_multiturn_trace(spec)
    progress = not args.no_progress
    orcapod = Endpoint("orcapod", http_base_url(args.url), client_api_key(args.api_key))
    summaries = {orcapod.name: measure(orcapod, trace, args.redis_url, args.prefix, progress)}
    if args.peer_url:
        peer = Endpoint(args.peer_name, args.peer_url, args.peer_api_key, args.peer_extra_body)
        summaries[peer.name] = measure(peer, trace, progress=progress)
    print()
    print(turn_table(summaries))
    print()
    print(overview_table(summaries))
    _write_results(args.out, asdict(spec), summaries)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``orcapod bench`` (a sweep against a running service)."""
    args = _parser().parse_args(argv)
    if args.trace == MULTITURN:
        try:
            return run_multiturn(args)
        except (LoadError, ValueError) as error:
            print(f"orcapod bench: {error}")
            return 1
    if args.max_tokens is None:
        args.max_tokens = DEFAULT_MAX_TOKENS
    rates = args.rates or parse_rates(QUICK_RATES if args.quick else "0.25")
    duration = args.duration or (QUICK_DURATION_S if args.quick else None)
    if duration is None and args.requests is None:
        duration = 60.0
    sweep = SweepSettings(
        args.trace, rates, duration, args.requests, args.seed, args.prompt_len, args.max_tokens
    )
    load = LoadSettings(
        url=args.url,
        max_sockets=args.max_sockets,
        drain_timeout_s=args.drain_timeout or (QUICK_DRAIN_S if args.quick else 120.0),
        seed=args.seed,
        progress=not args.no_progress,
        api_key=client_api_key(args.api_key),
    )
    stats = StatsReader(args.redis_url, args.prefix) if args.redis_url else None
    try:
        runs = run_sweep(sweep, load, stats, args.policy)
    except LoadError as error:
        print(f"orcapod bench: {error}")
        return 1
    finally:
        if stats is not None:
            stats.close()
    print()
    print(table(runs))
    _write_results(args.out, asdict(sweep), runs)
    return 0


def _write_results(out: Path, settings: dict, runs: object) -> None:
    """The run's JSON: the machine, the settings and every run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"machine": machine(), "settings": settings, "runs": runs}
    out.write_text(json.dumps(document, indent=1))
    print(f"\nwrote {out}")
