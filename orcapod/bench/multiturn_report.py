"""What the multi-turn benchmark records and reports (pure): one turn as the
client saw it (parsed from its server-sent events), the medians per turn
index, hit rates, the issue's targets, the tables, and the scheduler's cache
counters (the ``<prefix>:prefix_cache`` hash).

Token counts are the server's: ``usage.prompt_tokens_details.cached_tokens``,
and llama-server's ``timings.prompt_n`` (prompt tokens it actually computed)
where present.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from orcapod.bench.metrics import percentile

TTFT_RATIO_TARGET, PREFILL_RATIO_TARGET, TARGET_TURN = 1.5, 5.0, 8
PREFIX_CACHE_FIELDS = (
    "num_queries", "num_hits", "num_query_tokens", "num_hit_tokens", "num_evictions",
)  # fmt: skip


@dataclass(frozen=True)
class TurnRecord:
    """One turn; times in seconds, token counts as the server reported them (None: not
    reported). ``num_prefill_tokens``: prompt tokens the server computed, not cached."""

    conversation: int
    turn: int  # 1-based
    sent_s: float
    ttft_s: float | None
    latency_s: float
    num_prompt_tokens: int | None
    num_cached_tokens: int | None
    num_prefill_tokens: int | None
    num_completion_tokens: int
    finish_reason: str | None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")


def prompt_counts(
    usage: Mapping[str, Any] | None, timings: Mapping[str, Any] | None
) -> tuple[int | None, int | None, int | None]:
    """(prompt, cached, computed) tokens from a final chunk's ``usage`` and, from
    llama-server, ``timings`` (``prompt_n`` computed, ``cache_n`` reused)."""
    prompt = cached = computed = None
    if usage:
        prompt = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if timings and timings.get("prompt_n") is not None:
        computed = int(timings["prompt_n"])
        if cached is None and timings.get("cache_n") is not None:
            cached = int(timings["cache_n"])
    elif prompt is not None and cached is not None:
        computed = prompt - cached
    return prompt, cached, computed


class TurnStream:
    """One streamed chat answer, fed its server-sent-event lines as they arrive."""

    def __init__(self, sent_s: float) -> None:
        self.sent_s = sent_s
        self.first_token_s: float | None = None
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def feed(self, line: bytes, now_s: float) -> None:
        """One line of the response body (``data: {...}``, ``data: [DONE]``, or other)."""
        line = line.strip()
        if not line.startswith(b"data:") or self.done:
            return
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(payload)
        except ValueError:
            self.fail(f"not JSON: {payload[:80]!r}")
            return
        if event.get("error"):
            self.fail(str(event["error"].get("message", event["error"]))[:200])
            return
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                if self.first_token_s is None:
                    self.first_token_s = now_s
                self.parts.append(content)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            self.usage = event["usage"]
        if event.get("timings"):
            self.timings = event["timings"]

    def fail(self, error: str) -> None:
        """End the stream with ``error`` (the first one counts)."""
        self.error = self.error or error
        self.done = True

    def record(self, conversation: int, turn: int, ended_s: float) -> TurnRecord:
        """The turn's record once the stream ended at ``ended_s``."""
        prompt, cached, computed = prompt_counts(self.usage, self.timings)
        error = self.error
        if error is None and self.finish_reason is None:
            error = "the stream ended without a finish_reason"
        num_completion = (self.usage or {}).get("completion_tokens", len(self.parts))
        ttft_s = None if self.first_token_s is None else self.first_token_s - self.sent_s
        return TurnRecord(
            conversation, turn, self.sent_s, ttft_s, ended_s - self.sent_s,
            prompt, cached, computed, int(num_completion), self.finish_reason, error,
        )  # fmt: skip


# --- summaries (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class TurnSummary:
    """Medians over the conversations' completed turns of one turn index."""

    turn: int
    num_completed: int
    ttft_p50_s: float | None
    latency_p50_s: float | None
    prompt_tokens_p50: float | None
    cached_tokens_p50: float | None
    prefill_tokens_p50: float | None


def _median(values: Iterable[float | int | None]) -> float | None:
    return percentile([float(value) for value in values if value is not None], 50)


def summarize_turns(records: Iterable[TurnRecord]) -> list[TurnSummary]:
    """One summary per turn index that has a completed turn, in turn order."""
    by_turn: dict[int, list[TurnRecord]] = {}
    for record in records:
        if record.completed:
            by_turn.setdefault(record.turn, []).append(record)
    return [
        TurnSummary(
            turn,
            len(turns),
            _median(r.ttft_s for r in turns),
            _median(r.latency_s for r in turns),
            _median(r.num_prompt_tokens for r in turns),
            _median(r.num_cached_tokens for r in turns),
            _median(r.num_prefill_tokens for r in turns),
        )
        for turn, turns in sorted(by_turn.items())
    ]


def hit_rate(records: Iterable[TurnRecord]) -> float | None:
    """Cached / prompt tokens over the completed turns that report both."""
    counted = [
        (r.num_cached_tokens, r.num_prompt_tokens)
        for r in records
        if r.completed and r.num_cached_tokens is not None and r.num_prompt_tokens
    ]
    total = sum(prompt for _, prompt in counted)
    return sum(cached for cached, _ in counted) / total if total else None


def summarize_run(records: Sequence[TurnRecord], wall_s: float) -> dict[str, Any]:
    """Throughput, hit rate and the per-turn medians of one run."""
    completed = [record for record in records if record.completed]
    turns = summarize_turns(records)
    first, last = (turns[0], turns[-1]) if turns else (None, None)
    ratio = None
    if first and last and first.ttft_p50_s and last.ttft_p50_s is not None:
        ratio = last.ttft_p50_s / first.ttft_p50_s
    num_generated = sum(record.num_completion_tokens for record in completed)
    return {
        "num_sent": len(records),
        "num_completed": len(completed),
        "num_errors": sum(record.error is not None for record in records),
        "wall_s": wall_s,
        "turns_per_s": len(completed) / wall_s if wall_s > 0 else 0.0,
        "output_tok_s": num_generated / wall_s if wall_s > 0 else 0.0,
        "hit_rate": hit_rate(records),
        "prefill_tokens_total": sum(r.num_prefill_tokens or 0 for r in completed),
        "ttft_p50_s": _median(record.ttft_s for record in completed),
        "ttft_last_over_first": ratio,
        "by_turn": [asdict(summary) for summary in turns],
    }


def turn_entry(summary: Mapping[str, Any], turn: int) -> Mapping[str, Any] | None:
    """The ``by_turn`` entry of ``turn`` in a ``summarize_run`` dict (None: no such turn)."""
    return next((entry for entry in summary["by_turn"] if entry["turn"] == turn), None)


def verdicts(
    cache_on: Mapping[str, Any],
    cache_off: Mapping[str, Any] | None = None,
    routed: Mapping[str, Any] | None = None,
    unrouted: Mapping[str, Any] | None = None,
) -> list[str]:
    """PASS/MISS lines for the issue's targets at turn 8 (the last turn when fewer)."""
    lines = []
    last = max((entry["turn"] for entry in cache_on["by_turn"]), default=0)
    turn = min(TARGET_TURN, last)
    first, at_turn = turn_entry(cache_on, 1), turn_entry(cache_on, turn)
    if first and at_turn and first["ttft_p50_s"] and at_turn["ttft_p50_s"] is not None:
        ratio = at_turn["ttft_p50_s"] / first["ttft_p50_s"]
        verdict = "PASS" if ratio <= TTFT_RATIO_TARGET else "MISS"
        lines.append(
            f"{verdict} TTFT p50 at turn {turn} = {ratio:.3f} × turn 1's "
            f"(target ≤ {TTFT_RATIO_TARGET})"
        )
    off = turn_entry(cache_off, turn) if cache_off else None
    if at_turn and off and at_turn["prefill_tokens_p50"] is not None and off["prefill_tokens_p50"]:
        factor = off["prefill_tokens_p50"] / max(at_turn["prefill_tokens_p50"], 1.0)
        verdict = "PASS" if factor >= PREFILL_RATIO_TARGET else "MISS"
        lines.append(
            f"{verdict} prefill tokens at turn {turn}: {factor:.1f}× fewer than with the "
            f"cache off (target ≥ {PREFILL_RATIO_TARGET})"
        )
    if routed and unrouted and routed["hit_rate"] is not None and unrouted["hit_rate"] is not None:
        lines.append(
            f"hit rate with 2 workers: {routed['hit_rate']:.1%} cache-aware routing, "
            f"{unrouted['hit_rate']:.1%} routing that ignores the cache"
        )
    return lines


def _fmt(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def turn_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: one row per turn index, TTFT p50 and prefill tokens p50 of each run."""
    names = list(summaries)
    header = "| turn | " + " | ".join(f"{n} TTFT p50 s | {n} prefill tok p50" for n in names)
    rows = [header + " |", "|---:|" + "---:|" * (2 * len(names))]
    turns = sorted({entry["turn"] for s in summaries.values() for entry in s["by_turn"]})
    for turn in turns:
        cells = [str(turn)]
        for name in names:
            entry = turn_entry(summaries[name], turn) or {}
            cells += [_fmt(entry.get("ttft_p50_s")), _fmt(entry.get("prefill_tokens_p50"), 0)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def overview_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: one row per run (completed turns, hit rates, throughput, TTFT growth)."""
    rows = [
        "| run | turns done | err | hit rate | service hit rate | turns/s | out tok/s "
        "| TTFT p50 s | TTFT last / first |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        service = (s.get("service_cache") or {}).get("hit_rate")
        cells = [
            name, f"{s['num_completed']}/{s['num_sent']}", str(s["num_errors"]),
            _fmt(s["hit_rate"], 1, 100) + ("%" if s["hit_rate"] is not None else ""),
            _fmt(service, 1, 100) + ("%" if service is not None else ""),
            _fmt(s["turns_per_s"], 3), _fmt(s["output_tok_s"], 1),
            _fmt(s["ttft_p50_s"]), _fmt(s["ttft_last_over_first"]),
        ]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# --- the scheduler's cache counters --------------------------------------------------


def cache_counters(raw: Mapping[bytes, bytes]) -> dict[str, int]:
    """The ``<prefix>:prefix_cache`` hash (HGETALL) as integers (0 for a missing field)."""
    values = {key.decode(): int(value) for key, value in raw.items()}
    return {name: values.get(name, 0) for name in PREFIX_CACHE_FIELDS}


def service_cache(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, Any]:
    """The counters' deltas over a run and the token hit rate they give."""
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in PREFIX_CACHE_FIELDS}
    queried = delta["num_query_tokens"]
    return {**delta, "hit_rate": delta["num_hit_tokens"] / queried if queried else None}
