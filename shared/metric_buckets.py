"""Histogram buckets of the actors' metrics, vLLM's where a vLLM metric means
the same (so a vLLM dashboard's quantiles read alike), in one place."""

from __future__ import annotations

# vLLM's time to first token (seconds).
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's inter-token latency (seconds).
INTER_TOKEN_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# vLLM's request latencies: end to end, and each phase of a request (seconds).
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# A request's phases start finer: a CPU's short requests, an idle service's queue times.
REQUEST_PHASE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, *REQUEST_LATENCY_BUCKETS_S)
# vLLM's time per output token of a request, from 5 ms (seconds).
TIME_PER_OUTPUT_TOKEN_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# Tokens of one request, in 1-2-5 steps as vLLM's (which stop at the model's context).
REQUEST_TOKENS_BUCKETS = tuple(
    mantissa * 10**exponent for exponent in range(6) for mantissa in (1, 2, 5)
)
