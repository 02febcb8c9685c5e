"""orcapod bench: traces (seeded, in range), metrics, and one short run against a
real `orcapod up` (embedded SmolLM2) with the workers' stats read from Redis."""

from __future__ import annotations

import json
import random

import pytest

from orcapod.bench import main as bench_main
from orcapod.bench.loadgen import LoadError, check_loopback
from orcapod.bench.metrics import (
    RequestRecord,
    parse_stats,
    percentile,
    summarize_requests,
    summarize_service,
)
from orcapod.bench.service import benchmark_redis, orcapod_up
from orcapod.bench.targets import throughput_at_latency
from orcapod.bench.traces import TraceSpec, make_trace, poisson_arrivals


def test_orca_trace_is_seeded_and_in_the_paper_ranges():
    spec = TraceSpec("orca", rate_rps=2.0, seed=7, num_requests=2000)
    trace = make_trace(spec)
    assert trace == make_trace(spec)
    assert trace != make_trace(TraceSpec("orca", rate_rps=2.0, seed=8, num_requests=2000))
    assert len(trace) == 2000
    assert all(32 <= request.num_prompt_tokens <= 512 for request in trace)
    assert all(1 <= request.max_tokens <= 128 for request in trace)
    assert all(request.ignore_eos for request in trace)
    arrivals = [request.arrival_s for request in trace]
    assert arrivals == sorted(arrivals)
    # Poisson at 2/s: 2000 arrivals take about 1000 s.
    assert 900 < arrivals[-1] < 1100
    message = trace[0].generate_message("r0", seed=0)
    assert message.prompt_token_ids == list(trace[0].prompt_token_ids)
    assert message.ignore_eos and message.max_tokens == trace[0].max_tokens


def test_duration_bounds_a_trace_and_other_traces_have_their_shapes():
    trace = make_trace(TraceSpec("orca", rate_rps=1.0, duration_s=30.0))
    assert trace and trace[-1].arrival_s <= 30.0
    homogeneous = make_trace(
        TraceSpec("homogeneous", 1.0, num_requests=20, prompt_len=100, max_tokens=9)
    )
    assert {(r.num_prompt_tokens, r.max_tokens) for r in homogeneous} == {(100, 9)}
    chat = make_trace(TraceSpec("chat", 1.0, num_requests=10))
    assert all(not r.ignore_eos and r.chat_prompt for r in chat)
    assert chat[0].generate_message("c", seed=1).messages is not None
    mixed = make_trace(TraceSpec("mixed", 1.0, num_requests=200))
    assert {r.kind for r in mixed} == {"short", "long"}
    with pytest.raises(ValueError):
        TraceSpec("orca", 1.0)
    assert poisson_arrivals(random.Random(0), 1.0, 5, None)[4] > 0


def test_metrics_from_records():
    records = [
        RequestRecord(0, "orca", 4, sent_s=0.0, token_times_s=[1.0, 1.5, 2.0, 2.5]),
        RequestRecord(1, "orca", 2, sent_s=1.0, token_times_s=[1.2, 1.4]),
        RequestRecord(2, "orca", 2, sent_s=2.0, error="queue_full"),
        RequestRecord(3, "orca", 2, sent_s=3.0),  # never answered
    ]
    records[0].done_s, records[0].completion_tokens, records[0].finish_reason = 2.5, 4, "length"
    records[1].done_s, records[1].completion_tokens, records[1].finish_reason = 1.4, 2, "length"
    assert records[0].normalized_latency_s == pytest.approx(2.5 / 4)
    assert records[1].itls_s == pytest.approx([0.2])
    summary = summarize_requests(records, wall_s=2.0)
    assert (summary["num_completed"], summary["num_errors"], summary["num_unfinished"]) == (2, 1, 1)
    assert summary["throughput_rps"] == 1.0 and summary["throughput_tok_s"] == 3.0
    assert summary["normalized_latency_s"]["p50"] == pytest.approx((0.625 + 0.2) / 2)
    assert summary["ttft_s"]["p99"] == pytest.approx(0.2 + 0.99 * 0.8)
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_service_figures_from_two_stats_snapshots():
    before = parse_stats({b"w0:busy_s": b"1.0", b"w0:num_steps": b"10"})
    after = parse_stats(
        {
            b"w0:busy_s": b"10.5",
            b"w0:num_steps": b"110",
            b"w0:num_tokens": b"800",
            b"w0:num_requests": b"400",
            b"w0:step_gap_s": b"0.05",
            b"w0:num_step_gaps": b"100",
            b"w0:step_gap_le_us:500": b"30",
            b"w0:step_gap_le_us:1000": b"40",
            b"w0:step_gap_le_us:inf": b"30",
        }
    )
    service = summarize_service(before, after, wall_s=10.0, num_workers=1)
    assert service["busy_fraction"] == pytest.approx(0.95)
    assert service["tokens_per_step"] == 8 and service["mean_batch_size"] == 4
    assert service["step_gap_mean_ms"] == pytest.approx(0.5)
    assert service["step_gap_median_le_ms"] == 1.0


def test_throughput_at_latency_and_loopback_only():
    runs = [
        {"policy": "orca", "client": {"throughput_rps": r, "normalized_latency_s": {"p50": p}}}
        for r, p in ((0.1, 0.2), (0.2, 0.4), (0.3, 2.0))
    ]
    assert throughput_at_latency(runs, "orca", 0.5) == 0.2
    assert throughput_at_latency(runs, "request", 0.5) == 0.0
    check_loopback("ws://127.0.0.1:8000/ws")
    with pytest.raises(LoadError):
        check_loopback("ws://example.com:8000/ws")


@pytest.mark.model
def test_bench_quick_against_a_real_service(prepared_model_dir, tmp_path, capsys):
    """`orcapod bench` against `orcapod up` on a Redis the test owns: a handful of requests."""
    up_args = ["--model", str(prepared_model_dir), "--worker-arg=--kv-cache-bytes=67108864"]
    out = tmp_path / "bench.json"
    with (
        benchmark_redis() as redis,
        orcapod_up(redis.url, "fair", tmp_path / "up.log", up_args) as url,
    ):
        argv = ["--url", url, "--redis-url", redis.url, "--trace", "homogeneous"]
        argv += ["--prompt-len", "40", "--max-tokens", "6", "--rates", "2", "--requests", "4"]
        argv += ["--drain-timeout", "60", "--out", str(out), "--no-progress", "--policy", "fair"]
        assert bench_main(argv) == 0
    run = json.loads(out.read_text())["runs"][0]
    client, service = run["client"], run["service"]
    assert client["num_completed"] == 4 and client["num_errors"] == 0
    assert client["throughput_tok_s"] > 0 and client["itl_s"]["p50"] > 0
    assert 0 < service["busy_fraction"] <= 1.0
    assert service["tokens_per_step"] >= 1 and service["mean_batch_size"] >= 1
    assert service["step_gap_median_le_ms"] is not None
    assert "| homogeneous | fair |" in capsys.readouterr().out
