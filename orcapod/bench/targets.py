"""The issue's targets, judged from a ``compare`` run: one PASS/MISS line each.

The engine reference comes from ``bench/engine.py``'s ``engine.json``: the
decode step at the largest batch not above the scheduler's max batch size
gives the paper's latency target (2 × the engine's normalized execution
time there: one token per request per step, so the step time itself), and
with the prefill time per token it bounds the throughput of the Orca trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from orcapod.bench.traces import TraceSpec, make_trace

BUSY_TARGET, BOUND_TARGET, GAP_TARGET_MS, RATIO_TARGET, ITL_TARGET = 0.95, 0.8, 1.0, 10.0, 2.0
ITERATION_POLICIES = ("orca", "fair")
SATURATED_BUSY = 0.9  # a run this busy (or with requests left over) counts as saturated


@dataclass(frozen=True)
class EngineReference:
    """Engine step times taken from engine.json."""

    source: str
    date: str
    impl: str
    batch: int
    decode_step_s: float
    prefill_s_per_token: float

    @property
    def latency_target_s(self) -> float:
        """2 × the normalized execution time at the largest batch."""
        return 2 * self.decode_step_s

    def orca_trace_bound_rps(self) -> float:
        """Requests/s if every prompt token cost the prefill rate and every
        generated token the per-token cost of the largest decode batch."""
        trace = make_trace(TraceSpec("orca", 1.0, seed=12345, num_requests=5000))
        mean_prompt = fmean(request.num_prompt_tokens for request in trace)
        mean_generated = fmean(request.max_tokens for request in trace)
        per_request_s = (
            mean_prompt * self.prefill_s_per_token
            + mean_generated * self.decode_step_s / self.batch
        )
        return 1 / per_request_s

    @classmethod
    def load(cls, path: Path, max_batch_size: int) -> EngineReference | None:
        """The reference from ``path``; None when missing or without the rows needed."""
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        rows = document.get("results", [])
        for impl in ("cpu", "reference"):
            decodes = [
                row
                for row in rows
                if row.get("impl") == impl
                and row.get("measurement") == "decode"
                and row.get("batch", 0) <= max_batch_size
            ]
            prefills = [
                row for row in rows if row.get("impl") == impl and row["measurement"] == "prefill"
            ]
            if decodes and prefills:
                decode = max(decodes, key=lambda row: row["batch"])
                prefill = prefills[0]
                return cls(
                    source=str(path),
                    date=str(document.get("machine", {}).get("date", "?")),
                    impl=impl,
                    batch=int(decode["batch"]),
                    decode_step_s=decode["step_ms"] / 1000,
                    prefill_s_per_token=prefill["step_ms"] / 1000 / prefill["new_tokens"],
                )
        return None


def throughput_at_latency(runs: list[dict], policy: str, latency_s: float) -> float:
    """Highest completed req/s of ``policy`` with median normalized latency ≤ ``latency_s``."""
    return max(
        (
            run["client"]["throughput_rps"]
            for run in runs
            if run["policy"] == policy
            and (p50 := run["client"]["normalized_latency_s"]["p50"]) is not None
            and p50 <= latency_s
        ),
        default=0.0,
    )


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def _saturated_runs(runs: list[dict]) -> list[dict]:
    """The highest-rate run of each iteration-level policy."""
    chosen = []
    for policy in ITERATION_POLICIES:
        mine = [run for run in runs if run["policy"] == policy]
        if mine:
            chosen.append(max(mine, key=lambda run: run["rate_rps"]))
    return chosen


def _saturation_note(run: dict) -> str:
    busy = (run.get("service") or {}).get("busy_fraction") or 0.0
    saturated = run["client"]["num_unfinished"] > 0 or busy >= SATURATED_BUSY
    return "saturated" if saturated else "NOT saturated: raise --rates"


def verdicts(
    runs: list[dict],
    mixed_runs: list[dict],
    target_s: float | None,
    reference: EngineReference | None,
) -> list[str]:
    """One line per target, PASS or MISS with the numbers behind it."""
    lines = []
    if target_s is None:
        lines.append("MISS: no latency target (no engine.json; pass --latency-target-s)")
    else:
        baseline = throughput_at_latency(runs, "request", target_s)
        for policy in ITERATION_POLICIES:
            if not any(run["policy"] == policy for run in runs):
                continue
            mine = throughput_at_latency(runs, policy, target_s)
            if baseline > 0:
                ratio = mine / baseline
                lines.append(
                    f"{_verdict(ratio >= RATIO_TARGET)}: {policy} {mine:.3f} req/s vs request "
                    f"{baseline:.3f} req/s at median normalized latency ≤ {target_s:.3f} s/token "
                    f"= {ratio:.2f}× (target ≥ {RATIO_TARGET:.0f}×)"
                )
            else:
                lines.append(
                    f"{_verdict(mine > 0)}: {policy} {mine:.3f} req/s at ≤ {target_s:.3f} "
                    "s/token; request never met the target at any swept rate (ratio unbounded)"
                )
    for run in _saturated_runs(runs):
        service = run.get("service") or {}
        note = f"{run['policy']} @ {run['rate_rps']}/s, {_saturation_note(run)}"
        busy = service.get("busy_fraction")
        if busy is not None:
            lines.append(
                f"{_verdict(busy >= BUSY_TARGET)}: engine busy fraction {busy:.3f} "
                f"(target ≥ {BUSY_TARGET}) [{note}]"
            )
        gap = service.get("step_gap_median_le_ms")
        if gap is not None:
            lines.append(
                f"{_verdict(gap <= GAP_TARGET_MS)}: median gap between steps ≤ {gap:.1f} ms, "
                f"mean {service.get('step_gap_mean_ms') or 0:.2f} ms "
                f"(target < {GAP_TARGET_MS} ms) [{note}]"
            )
    saturated = _saturated_runs(runs)
    if reference is not None and saturated:
        best = max(saturated, key=lambda run: run["client"]["throughput_rps"])
        bound = reference.orca_trace_bound_rps()
        share = best["client"]["throughput_rps"] / bound
        lines.append(
            f"{_verdict(share >= BOUND_TARGET)}: saturated throughput "
            f"{best['client']['throughput_rps']:.3f} req/s = {share:.0%} of the engine bound "
            f"{bound:.3f} req/s from {reference.source} ({reference.date}; decode {reference.impl} "
            f"batch {reference.batch} {reference.decode_step_s * 1000:.0f} ms, prefill "
            f"{reference.prefill_s_per_token * 1000:.2f} ms/token) (target ≥ {BOUND_TARGET:.0%})"
        )
    unloaded = next((run for run in mixed_runs if run["trace"] == "short"), None)
    mixed = next((run for run in mixed_runs if run["trace"] == "mixed"), None)
    if unloaded and mixed and "short" in mixed["by_kind"]:
        alone = unloaded["client"]["itl_s"]["p99"]
        loaded = mixed["by_kind"]["short"]["itl_s"]["p99"]
        if alone and loaded:
            ratio = loaded / alone
            lines.append(
                f"{_verdict(ratio <= ITL_TARGET)}: short chats' p99 ITL {loaded * 1000:.0f} ms "
                f"mixed with long prompts vs {alone * 1000:.0f} ms alone = {ratio:.2f}× "
                f"(target ≤ {ITL_TARGET:.0f}×, fair, chunked prefill)"
            )
    return lines
