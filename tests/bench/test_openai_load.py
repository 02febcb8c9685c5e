"""The pure parts of ``bench/openai_load.py``: reading AIPerf's and ``orcapod bench``'s
result files, and the commands both get for one load (the runs themselves are by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.openai_load as openai_load


def _ms(p50: float, p99: float) -> dict:
    return {"unit": "ms", "avg": (p50 + p99) / 2, "p50": p50, "p99": p99, "count": 5}


AIPERF_EXPORT = {
    "aiperf_version": "0.13.0",
    "request_throughput": {"unit": "requests/sec", "avg": 0.25},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 16.0},
    "request_count": {"unit": "requests", "avg": 5.0},
    "output_sequence_length": {"unit": "tokens", "avg": 64.0, "p50": 64.0, "p99": 64.0},
    "overall_usage_prompt_cache_read_pct": {"unit": "%", "avg": 0.0},
    "time_to_first_token": _ms(20.0, 560.0),
    "inter_chunk_latency": _ms(11.0, 204.0),
    "inter_token_latency": _ms(13.0, 42.0),
    "request_latency": _ms(850.0, 3180.0),
    "error_summary": [{"error_details": {"code": 400}, "count": 2}],
}


def test_aiperf_summary_in_seconds_with_errors_from_the_error_summary() -> None:
    summary = openai_load.parse_aiperf(AIPERF_EXPORT, "orcapod")

    assert (summary.tool, summary.target) == ("aiperf 0.13.0", "orcapod")
    assert (summary.num_completed, summary.num_errors) == (5, 2)
    assert (summary.requests_per_s, summary.output_tokens_per_s) == (0.25, 16.0)
    assert summary.ttft_s == openai_load.Percentiles(0.02, 0.56)
    assert summary.itl_s == openai_load.Percentiles(0.011, 0.204)
    assert summary.tpot_s == openai_load.Percentiles(0.013, 0.042)
    assert summary.e2e_s == openai_load.Percentiles(0.85, 3.18)
    assert summary.mean_output_tokens == 64.0 and summary.cached_prompt_pct == 0.0


def test_aiperf_summary_without_streamed_metrics() -> None:
    document = {k: v for k, v in AIPERF_EXPORT.items() if k not in ("inter_token_latency",)}

    summary = openai_load.parse_aiperf(document, "peer")

    assert summary.tpot_s is None
    assert summary.itl_s.p50 == pytest.approx(0.011)


def _orcapod_bench(rps: float, tok_s: float) -> dict:
    client = {
        "num_sent": 6, "num_completed": 5, "num_errors": 1, "num_unfinished": 0,
        "throughput_rps": rps, "throughput_tok_s": tok_s,
        "normalized_latency_s": {"p50": 0.05, "p99": 0.1},
        "ttft_s": {"p50": 0.3, "p99": 1.2}, "itl_s": {"p50": 0.04, "p99": 0.2},
    }  # fmt: skip
    return {"machine": {}, "settings": {}, "runs": [{"client": client}]}


def test_orcapod_bench_e2e_is_normalized_latency_times_the_exact_length() -> None:
    summary = openai_load.parse_orcapod_bench(_orcapod_bench(0.25, 16.0), "orcapod", 64)

    assert (summary.num_completed, summary.num_errors) == (5, 1)
    assert summary.mean_output_tokens == pytest.approx(64.0)
    assert summary.e2e_s.p50 == pytest.approx(3.2) and summary.e2e_s.p99 == pytest.approx(6.4)
    assert summary.ttft_s == openai_load.Percentiles(0.3, 1.2)
    assert summary.itl_s == openai_load.Percentiles(0.04, 0.2)
    assert summary.tpot_s is None


def test_orcapod_bench_e2e_left_out_when_a_request_stopped_early() -> None:
    summary = openai_load.parse_orcapod_bench(_orcapod_bench(0.25, 15.0), "orcapod", 64)

    assert summary.e2e_s is None
    assert summary.mean_output_tokens == pytest.approx(60.0)


def test_both_tools_get_the_same_load(tmp_path: Path) -> None:
    load = openai_load.Load(prompt_tokens=128, output_tokens=64, rate_rps=0.3, duration_s=60)
    aiperf = openai_load.aiperf_command(
        Path("aiperf"), "http://127.0.0.1:8790", "m", load, tmp_path, tmp_path / "a", api_key="k"
    )
    ours = openai_load.orcapod_bench_command(
        openai_load.websocket_url("http://127.0.0.1:8790"), load, tmp_path / "o.json", None
    )

    def flag(command: list[str], name: str) -> str:
        return command[command.index(name) + 1]

    assert (flag(aiperf, "--isl"), flag(ours, "--prompt-len")) == ("128", "128")
    assert (flag(aiperf, "--osl"), flag(ours, "--max-tokens")) == ("64", "64")
    assert (flag(aiperf, "--request-rate"), flag(ours, "--rates")) == ("0.3", "0.3")
    assert flag(aiperf, "--benchmark-duration") == flag(ours, "--duration") == "60"
    assert flag(aiperf, "--benchmark-grace-period") == flag(ours, "--drain-timeout")
    assert flag(aiperf, "--arrival-pattern") == "poisson"
    assert flag(aiperf, "--extra-inputs") == "ignore_eos:true"
    assert flag(aiperf, "--api-key") == "k" and "--api-key" not in ours
    assert flag(ours, "--url") == "ws://127.0.0.1:8790/ws"


def test_only_loopback_urls_are_benchmarked() -> None:
    openai_load.check_loopback("http://127.0.0.1:8790")
    for url in ("http://10.0.0.1:8000", "http://example.com", "ws://127.0.0.1:8790/ws"):
        with pytest.raises(SystemExit):
            openai_load.check_loopback(url)
