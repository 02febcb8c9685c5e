"""End to end: redis-server, ``python -m scheduler_actor`` and ``python -m gpu_worker``
as real processes with ``--metrics-port``; one request runs, then both ``/metrics``
are scraped over HTTP and parsed."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gpu_worker.__main__ import parse_settings as parse_worker_settings
from scheduler_actor.__main__ import parse_settings as parse_scheduler_settings
from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import (
    SamplingParams,
    SubmitRequest,
    TokenBatch,
    decode_gateway_message,
    encode,
)
from shared.metrics_http import metrics_url
from tests.conftest import free_port
from tests.gpu_worker.tiny_models import write_tiny_model
from tests.test_service_actors import running_actors

KEYS = RedisKeys("metrics-e2e")
GATEWAY = "gw-metrics"
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def test_the_metrics_flags_reach_the_settings() -> None:
    assert parse_scheduler_settings([]).metrics_port is None
    scheduler = parse_scheduler_settings(["--metrics-port", "9090", "--metrics-host", "0.0.0.0"])
    assert (scheduler.metrics_host, scheduler.metrics_port) == ("0.0.0.0", 9090)
    worker = parse_worker_settings(["--metrics-port", "0"])
    assert (worker.metrics_host, worker.metrics_port) == ("127.0.0.1", 0)


@pytest.fixture
def ports() -> dict[str, int]:
    return {"scheduler": free_port(), "worker": free_port()}


@pytest.fixture
def service(
    redis_server, tmp_path: Path, ports: dict[str, int]
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The scheduler and one worker, each serving /metrics."""
    model_dir = write_tiny_model(tmp_path / "tiny", "llama")
    with running_actors(
        redis_server.url,
        KEYS.prefix,
        model_dir,
        tmp_path,
        worker_args=[f"--metrics-port={ports['worker']}"],
        scheduler_args=[f"--metrics-port={ports['scheduler']}", f"--model={model_dir}"],
    ) as processes:
        yield processes


def scrape(port: int) -> Samples:
    """GET /metrics on loopback, parsed; every sample names the served model
    (the tiny model's directory), checked and left out."""
    with urllib.request.urlopen(metrics_url("127.0.0.1", port), timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == "tiny", sample
            samples.setdefault(sample.name, {})[tuple(sorted(labels.items()))] = sample.value
    return samples


def test_scheduler_and_worker_serve_their_metrics(redis_server, service, ports) -> None:
    client = redis.Redis.from_url(redis_server.url)
    pubsub = client.pubsub()
    pubsub.subscribe(KEYS.tokens(GATEWAY))
    deadline = time.monotonic() + 40
    while not client.exists(KEYS.ready):
        assert time.monotonic() < deadline, "the service never became ready"
        time.sleep(0.1)
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    submit = SubmitRequest("r1", GATEWAY, "acme", [5, 9, 11, 40, 7, 3], sampling)
    client.xadd(KEYS.requests, {MESSAGE_FIELD: encode(submit)})
    num_tokens = 0
    deadline = time.monotonic() + 30
    while num_tokens < sampling.max_tokens:
        assert time.monotonic() < deadline, f"only {num_tokens} tokens"
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if message is not None:
            batch = decode_gateway_message(message["data"])
            assert isinstance(batch, TokenBatch)
            num_tokens += len(batch.tokens)
    pubsub.close()

    worker = scrape(ports["worker"])
    steps = worker["orcapod_steps_total"][(("worker", "w1"),)]
    assert steps >= 5  # the prompt's step, then one per further token
    # One series per path the steps took; the suite's workers run eagerly.
    step_counts = worker["orcapod_step_time_seconds_count"]
    assert step_counts == {(("path", "eager"), ("worker", "w1")): steps}
    assert worker["orcapod_tokens_per_step_sum"][(("worker", "w1"),)] == 6 + 4

    scheduler = scrape(ports["scheduler"])
    assert scheduler["orcapod_plans_total"][(("worker", "w1"),)] >= steps
    assert scheduler["orcapod_kv_pool_blocks"][(("worker", "w1"),)] > 0
    # The request ended (its last result may still be on its way back).
    deadline = time.monotonic() + 5
    while scheduler["orcapod_num_requests_running"][()]:
        assert time.monotonic() < deadline, scheduler["orcapod_num_requests_running"]
        time.sleep(0.05)
        scheduler = scrape(ports["scheduler"])
    assert "orcapod_tenant_requests_running" not in scheduler
    assert scheduler["orcapod_num_requests_waiting"] == {(): 0}
    # Its phases: placed, prefilled, four more tokens.
    assert scheduler["orcapod_request_generation_tokens_sum"][()] == 5
    assert scheduler["orcapod_request_prompt_tokens_sum"][()] == 6
    assert scheduler["orcapod_request_time_per_output_token_seconds_count"][()] == 1
    for phase in ("queue", "prefill", "decode", "inference"):
        assert scheduler[f"orcapod_request_{phase}_time_seconds_count"][()] == 1, phase
    assert scheduler["orcapod_vtc_service"][(("tenant", "acme"),)] == 6 + 2 * 5
    assert scheduler["orcapod_kv_blocks_used"][(("worker", "w1"),)] == 0

    for process in service.values():
        process.send_signal(signal.SIGTERM)
    for name, process in service.items():
        assert process.wait(timeout=15) == 0, name
