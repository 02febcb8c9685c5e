"""What one benchmark run measured: client-side latencies and the service's own counters.

Definitions (docs/performance.md, "How to measure"; design brief "Measuring"):

- normalized latency = end-to-end latency / generated tokens;
- TTFT = first token - send; ITL = gaps between consecutive tokens of a request;
- throughput = completed requests (and their generated tokens) / the run's
  wall time, from the first send to the last answer;
- from the workers' stats hash (deltas over the run, summed over workers):
  busy fraction = time inside forward passes / (wall time × workers), tokens
  per step, mean batch size, and the gap between consecutive forward passes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

GAP_BUCKET = ":step_gap_le_us:"


@dataclass
class RequestRecord:
    """One request as the client saw it (times from the loop's monotonic clock)."""

    index: int
    kind: str
    max_tokens: int
    sent_s: float
    token_times_s: list[float] = field(default_factory=list)
    done_s: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        """Ended with stop or length (not cancelled, not an error)."""
        return self.finish_reason in ("stop", "length") and self.error is None

    @property
    def latency_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    @property
    def normalized_latency_s(self) -> float | None:
        """End-to-end latency per generated token."""
        latency = self.latency_s
        if latency is None or self.completion_tokens == 0:
            return None
        return latency / self.completion_tokens

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def itls_s(self) -> list[float]:
        times = self.token_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _p50_p99(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def summarize_requests(records: Iterable[RequestRecord], wall_s: float) -> dict:
    """Throughput and latency percentiles of the completed requests."""
    records = list(records)
    completed = [record for record in records if record.completed]
    tokens = sum(record.completion_tokens for record in completed)
    normalized = [r.normalized_latency_s for r in completed if r.normalized_latency_s is not None]
    ttfts = [record.ttft_s for record in completed if record.ttft_s is not None]
    itls = [itl for record in completed for itl in record.itls_s]
    return {
        "num_sent": len(records),
        "num_completed": len(completed),
        "num_errors": sum(record.error is not None for record in records),
        "num_unfinished": sum(record.error is None and not record.completed for record in records),
        "wall_s": wall_s,
        "throughput_rps": len(completed) / wall_s if wall_s > 0 else 0.0,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "normalized_latency_s": _p50_p99(normalized),
        "ttft_s": _p50_p99(ttfts),
        "itl_s": _p50_p99(itls),
    }


def summarize_by_kind(records: Sequence[RequestRecord], wall_s: float) -> dict[str, dict]:
    """``summarize_requests`` for each kind of request in a trace that mixes kinds."""
    kinds = sorted({record.kind for record in records})
    if len(kinds) < 2:
        return {}
    return {
        kind: summarize_requests([r for r in records if r.kind == kind], wall_s) for kind in kinds
    }


def parse_stats(raw: Mapping[bytes, bytes]) -> dict[str, float]:
    """The stats hash (HGETALL) summed over workers: {suffix or gap bucket: value}."""
    totals: dict[str, float] = {}
    for raw_key, raw_value in raw.items():
        _, _, name = raw_key.decode().partition(":")
        totals[name] = totals.get(name, 0.0) + float(raw_value)
    return totals


def _gap_median_us(gap_buckets: dict[str, float]) -> float | None:
    """Upper edge of the histogram bucket holding the median gap."""
    total = sum(gap_buckets.values())
    if total <= 0:
        return None
    edges = sorted(gap_buckets, key=lambda edge: math.inf if edge == "inf" else float(edge))
    seen = 0.0
    for edge in edges:
        seen += gap_buckets[edge]
        if seen >= total / 2:
            return math.inf if edge == "inf" else float(edge)
    return None


def summarize_service(
    before: Mapping[str, float], after: Mapping[str, float], wall_s: float, num_workers: int
) -> dict[str, float | None]:
    """Service-side figures of one run from two ``parse_stats`` snapshots."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    num_steps = delta("num_steps")
    num_gaps = delta("num_step_gaps")
    buckets = {
        name.removeprefix(GAP_BUCKET[1:]): delta(name)
        for name in after
        if name.startswith(GAP_BUCKET[1:])
    }
    return {
        "busy_fraction": delta("busy_s") / (wall_s * num_workers) if wall_s > 0 else None,
        "num_steps": num_steps,
        "tokens_per_step": delta("num_tokens") / num_steps if num_steps else None,
        "mean_batch_size": delta("num_requests") / num_steps if num_steps else None,
        "mean_step_ms": 1000 * delta("busy_s") / num_steps if num_steps else None,
        "step_gap_mean_ms": 1000 * delta("step_gap_s") / num_gaps if num_gaps else None,
        "step_gap_median_le_ms": (
            None if (median := _gap_median_us(buckets)) is None else median / 1000
        ),
    }


def _fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value * scale:.{digits}f}"


TABLE_HEADER = (
    "| trace | policy | rate/s | done | err | req/s | tok/s | norm p50 s | norm p99 s "
    "| TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | busy | batch | tok/step "
    "| gap p50 ≤ ms |"
)


def table_row(run: dict) -> str:
    """One markdown table row of a run (see ``TABLE_HEADER``)."""
    client, service = run["client"], run.get("service") or {}
    cells = [
        run["trace"],
        run.get("policy") or "-",
        _fmt(run["rate_rps"], digits=2),
        f"{client['num_completed']}/{client['num_sent']}",
        str(client["num_errors"]),
        _fmt(client["throughput_rps"]),
        _fmt(client["throughput_tok_s"], digits=1),
        _fmt(client["normalized_latency_s"]["p50"]),
        _fmt(client["normalized_latency_s"]["p99"]),
        _fmt(client["ttft_s"]["p50"], digits=2),
        _fmt(client["ttft_s"]["p99"], digits=2),
        _fmt(client["itl_s"]["p50"], 1000, 0),
        _fmt(client["itl_s"]["p99"], 1000, 0),
        _fmt(service.get("busy_fraction"), digits=2),
        _fmt(service.get("mean_batch_size"), digits=1),
        _fmt(service.get("tokens_per_step"), digits=1),
        _fmt(service.get("step_gap_median_le_ms"), digits=1),
    ]
    return "| " + " | ".join(cells) + " |"


def table(runs: Sequence[dict]) -> str:
    """A markdown table of runs."""
    separator = "|" + "---|" * 2 + "---:|" * 15
    return "\n".join([TABLE_HEADER, separator, *(table_row(run) for run in runs)])
