"""End to end: redis-server, ``python -m scheduler_actor`` and ``python -m gpu_worker``
as real processes; the test plays the gateway."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis

from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.model_loading import load_model
from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import (
    SamplingParams,
    SubmitRequest,
    TokenBatch,
    decode_gateway_message,
    encode,
)
from shared.settings import WorkerSettings
from tests.gpu_worker.plans import Job, run_jobs
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
KEYS = RedisKeys("e2e")
GATEWAY = "gw-e2e"
KV_CACHE_BYTES = 4 << 20


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny", "llama")


def start(module: str, *args: str, log_path: Path) -> subprocess.Popen[bytes]:
    """``python -m module args`` from the repository root, stderr to ``log_path``."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=ROOT, stdout=log, stderr=log
        )


@contextlib.contextmanager
def running_actors(
    redis_url: str,
    prefix: str,
    model_dir: Path,
    tmp_path: Path,
    worker_args: Sequence[str] = (),
    scheduler_args: Sequence[str] = (),
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The scheduler and one worker (``w1``), stopped (SIGKILL) afterwards if
    still running; their logs go to the test's output."""
    common = ["--redis-url", redis_url, "--prefix", prefix]
    processes = {
        "worker": start(
            "gpu_worker",
            *common,
            "--worker-id=w1",
            f"--model={model_dir}",
            "--device=cpu",
            "--dtype=float32",
            f"--kv-cache-bytes={KV_CACHE_BYTES}",
            *worker_args,
            log_path=tmp_path / "worker.log",
        ),
        "scheduler": start(
            "scheduler_actor", *common, *scheduler_args, log_path=tmp_path / "scheduler.log"
        ),
    }
    try:
        yield processes
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        for name in processes:
            sys.stderr.write(f"--- {name} log ---\n{(tmp_path / f'{name}.log').read_text()}\n")


@pytest.fixture(params=["lookahead-1", "lookahead-default"])
def service(
    request: pytest.FixtureRequest, redis_server, model_dir: Path, tmp_path: Path
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The scheduler and one worker, which takes one plan at a time (the
    scheduler waits for each result) or its default number ahead."""
    worker_args = ["--max-inflight=1"] if request.param == "lookahead-1" else []
    with running_actors(
        redis_server.url,
        KEYS.prefix,
        model_dir,
        tmp_path,
        worker_args=worker_args,
        scheduler_args=["--token-budget=48"],
    ) as processes:
        yield processes


def expected_tokens(model_dir: Path, jobs: list[Job]) -> dict[str, list[int]]:
    """What the engine gives each request on its own, in the worker's default format."""
    model = load_model(model_dir, "cpu", "float32", WorkerSettings.weight_format)
    engine = Engine(model, KVCacheBudget(num_bytes=KV_CACHE_BYTES), "cpu")
    return {job.request_id: run_jobs_alone(engine, job) for job in jobs}


def run_jobs_alone(engine: Engine, job: Job) -> list[int]:
    fresh = Job(job.request_id, job.prompt_ids, job.sampling)
    run_jobs(engine, [fresh])
    return fresh.generated_ids


def test_concurrent_requests_get_every_token_once_in_order(redis_server, service, model_dir):
    client = redis.Redis.from_url(redis_server.url)
    pubsub = client.pubsub()
    pubsub.subscribe(KEYS.tokens(GATEWAY))
    deadline = time.monotonic() + 40
    while not client.exists(KEYS.ready):
        assert time.monotonic() < deadline, "the service never became ready"
        assert all(p.poll() is None for p in service.values()), "an actor exited"
        time.sleep(0.1)

    rng = random.Random(7)
    jobs = [
        Job(
            f"r{number}",
            [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(length)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        for number, (length, max_tokens) in enumerate([(5, 12), (30, 6), (70, 9), (17, 15)])
    ]
    for job in jobs:
        message = SubmitRequest(job.request_id, GATEWAY, "tenant", job.prompt_ids, job.sampling)
        client.xadd(KEYS.requests, {MESSAGE_FIELD: encode(message)})

    received: dict[str, list[tuple[int, int]]] = {job.request_id: [] for job in jobs}
    finished: set[str] = set()
    deadline = time.monotonic() + 30
    while len(finished) < len(jobs):
        assert time.monotonic() < deadline, f"only {finished} finished"
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if message is None:
            continue
        batch = decode_gateway_message(message["data"])
        assert isinstance(batch, TokenBatch), batch
        for token in batch.tokens:
            received[token.request_id].append((token.index, token.token_id))
            if token.finish_reason is not None:
                assert token.finish_reason == "length"
                finished.add(token.request_id)
    pubsub.close()

    expected = expected_tokens(model_dir, jobs)
    for job in jobs:
        indices = [index for index, _ in received[job.request_id]]
        assert indices == list(range(job.sampling.max_tokens)), job.request_id
        assert [token for _, token in received[job.request_id]] == expected[job.request_id]

    for process in service.values():
        process.send_signal(signal.SIGTERM)
    for name, process in service.items():
        assert process.wait(timeout=15) == 0, name
