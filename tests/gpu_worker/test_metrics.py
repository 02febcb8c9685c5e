"""The worker's metrics: the busy window on a fake clock, a tiny engine's real
steps, and the worker actor against a real redis-server scraped over HTTP;
every check parses the text format with prometheus_client's parser."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_worker.actor import WorkerActor
from gpu_worker.engine import Engine
from gpu_worker.engine_host import EngineThread
from gpu_worker.llama import LlamaModel
from gpu_worker.local_blocks import step_alone
from gpu_worker.metrics import BusyWindow, WorkerMetrics
from gpu_worker.model_loading import load_model
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from shared.metrics_http import metrics_url, serve_metrics
from shared.redis_streams import connect
from shared.settings import ModelLocation, RedisSettings, WorkerSettings
from tests.gpu_worker.plans import grants_up_front
from tests.gpu_worker.test_actor import KEYS, WORKER, Scheduler, admit, decode, make_engine
from tests.gpu_worker.tiny_models import write_tiny_model

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(model_dir, device="cpu", dtype="float32")


def parse(text: str) -> Samples:
    """Sample name -> (sorted labels -> value)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def of_worker(samples: Samples, name: str, worker_id: str = WORKER, **labels: str) -> float:
    """The worker's value of ``name``, summed over the labels not given (a step's path)."""
    wanted = {"worker": worker_id, **labels}
    return sum(
        value
        for sample_labels, value in samples[name].items()
        if wanted.items() <= dict(sample_labels).items()
    )


def bucket(samples: Samples, name: str, le: str, worker_id: str = WORKER) -> float:
    return of_worker(samples, f"{name}_bucket", worker_id, le=le)


def paths(samples: Samples, name: str, worker_id: str = WORKER) -> set[str]:
    """The ``path`` labels of the worker's samples of ``name``."""
    return {
        dict(labels)["path"]
        for labels in samples[name]
        if dict(labels).get("worker") == worker_id and "path" in dict(labels)
    }


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_the_busy_window_is_the_busy_share_of_the_last_seconds() -> None:
    window = BusyWindow(window_s=5.0, started_s=0.0)
    assert window.fraction(0.0) == 0.0
    window.add(1.0, 0.5)
    assert window.fraction(2.0) == pytest.approx(0.25)  # 0.5 s of the 2 s so far
    for end_s in (3.0, 4.0, 5.0, 6.0):
        window.add(end_s, 0.5)
    assert window.fraction(6.0) == pytest.approx(2.0 / 5.0)  # the step at 1.0 s left
    assert window.fraction(10.5) == pytest.approx(0.5 / 5.0)  # only the step at 6.0 s
    assert window.fraction(11.0) == 0.0  # idle for a whole window
    window.add(11.5, 9.0)  # one long step: capped
    assert window.fraction(11.5) == 1.0


def _plans() -> list[StepPlan]:
    """Two requests: prompts in two chunks, then decodes until max_tokens."""
    prompts = {"a": [5, 9, 11, 40, 7, 3], "b": [8, 12, 13]}
    specs = [RequestSpec(rid, len(ids), GREEDY) for rid, ids in prompts.items()]
    return [
        StepPlan(
            "w",
            0,
            0,
            new_requests=specs,
            prefill_chunks=[PrefillChunk("a", [5, 9, 11], 0)],
            block_grants=grants_up_front(specs),
        ),
        StepPlan(
            "w",
            0,
            1,
            prefill_chunks=[PrefillChunk("a", [40, 7, 3], 3), PrefillChunk("b", [8, 12, 13], 0)],
        ),
        *(StepPlan("w", 0, 2 + i, decode_request_ids=["a", "b"]) for i in range(3)),
    ]


def test_engine_steps_fill_the_histograms_and_totals(model: LlamaModel) -> None:
    engine = make_engine(model)
    clock = FakeClock()
    metrics = WorkerMetrics("w", engine.stats, clock=clock, window_s=5.0)
    step_s: list[float] = []
    for plan in _plans():
        output = step_alone(engine, plan)
        clock.now_s += 0.5
        metrics.observe_step(output, len(plan.prefill_chunks) + len(plan.decode_request_ids))
        step_s.append(output.step_ms / 1000)
    # A plan that runs no forward pass is no step.
    empty = step_alone(engine, StepPlan("w", 0, 9, released_request_ids=["a"]))
    metrics.observe_step(empty, 0)

    samples = parse(generate_latest(metrics.registry).decode())
    # The totals are the engine's own counters.
    assert of_worker(samples, "orcapod_steps_total", "w") == engine.stats.num_steps == 5
    assert of_worker(samples, "orcapod_busy_seconds_total", "w") == engine.stats.busy_s
    step_time = "orcapod_step_time_seconds"
    assert of_worker(samples, f"{step_time}_count", "w") == 5
    assert of_worker(samples, f"{step_time}_sum", "w") == pytest.approx(sum(step_s))
    assert bucket(samples, step_time, "+Inf", "w") == 5
    assert bucket(samples, step_time, "10.0", "w") == 5  # a tiny model's step is far below 10 s
    # Labelled by the path each step took (an eager engine: all eager).
    assert paths(samples, f"{step_time}_count", "w") == {"eager"}
    # Batch sizes 1, 2, 2, 2, 2; new tokens 3, 6, 2, 2, 2.
    assert of_worker(samples, "orcapod_batch_size_count", "w") == 5
    assert of_worker(samples, "orcapod_batch_size_sum", "w") == 9
    assert bucket(samples, "orcapod_batch_size", "1.0", "w") == 1
    assert bucket(samples, "orcapod_batch_size", "2.0", "w") == 5
    assert of_worker(samples, "orcapod_tokens_per_step_sum", "w") == engine.stats.num_tokens == 15
    assert bucket(samples, "orcapod_tokens_per_step", "2.0", "w") == 3
    assert bucket(samples, "orcapod_tokens_per_step", "4.0", "w") == 4
    # All five steps ended within the last 5 s of the fake clock (2.5 s elapsed).
    busy = of_worker(samples, "orcapod_busy_fraction", "w")
    assert busy == pytest.approx(sum(step_s) / 2.5)
    clock.now_s += 10
    idle = parse(generate_latest(metrics.registry).decode())
    assert of_worker(idle, "orcapod_busy_fraction", "w") == 0.0


def test_the_worker_actor_reports_its_steps_over_http(redis_server, model: LlamaModel) -> None:
    """Plans through a real redis-server, the registry scraped from a real server."""
    engine: Engine = make_engine(model)

    async def main() -> str:
        settings = WorkerSettings(
            redis=RedisSettings(url=redis_server.url, prefix=KEYS.prefix),
            model=ModelLocation(cache_dir=Path("."), model_dir=Path(".")),
            worker_id=WORKER,
        )
        worker_redis, test_redis = connect(redis_server.url), connect(redis_server.url)
        pubsub = test_redis.pubsub()
        actor = WorkerActor(settings, worker_redis, EngineThread(engine, settings.worker_id))
        stop = asyncio.Event()
        bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(actor.run(stop))
                tasks.create_task(
                    serve_metrics(actor.metrics.registry, "127.0.0.1", 0, stop, bound.set_result)
                )
                try:
                    scheduler = Scheduler(test_redis, pubsub)
                    await scheduler.joined()
                    for plan in (admit(1), decode(2, ["r0", "r1"]), decode(3, ["r0", "r1"])):
                        await scheduler.send(plan)
                    for _ in range(3):
                        await scheduler.result()
                    url = metrics_url("127.0.0.1", await asyncio.wait_for(bound, 5))
                    async with aiohttp.ClientSession() as session, session.get(url) as response:
                        assert response.status == 200
                        return await response.text()
                finally:
                    stop.set()
        finally:
            await pubsub.aclose()
            await worker_redis.aclose()
            await test_redis.aclose()

    samples = parse(asyncio.run(main()))
    assert of_worker(samples, "orcapod_steps_total") == engine.stats.num_steps == 3
    assert of_worker(samples, "orcapod_step_time_seconds_count") == 3
    assert of_worker(samples, "orcapod_step_time_seconds_sum") == pytest.approx(engine.stats.busy_s)
    # Both requests in every step; their prompts (4 + 3 tokens), then one token each.
    assert of_worker(samples, "orcapod_batch_size_sum") == 6
    assert of_worker(samples, "orcapod_tokens_per_step_sum") == engine.stats.num_tokens == 11
    assert 0 < of_worker(samples, "orcapod_busy_fraction") <= 1
