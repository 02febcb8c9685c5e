"""The engine in a process of its own: it loads the model, runs plans sent over
its pipe exactly as the in-process engine does, and its death ends the worker."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpu_worker.engine import Engine
from gpu_worker.engine_host import (
    ENGINE_EXIT_WAIT_S,
    OPENMP_SPIN_COUNT,
    EngineProcess,
    EngineProcessDied,
    EngineThread,
    PlanJob,
    _child_environment,
    engine_environment_defaults,
)
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.model_loading import load_model
from gpu_worker.path_compiler import held_back_blocks
from gpu_worker.plan_runner import StepDone
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from shared.settings import RedisSettings, WorkerSettings, model_location
from tests.gpu_worker.tiny_models import write_tiny_model

KV_CACHE_BYTES = 4 << 20
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPT = [5, 9, 11, 40, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def _settings(model_dir: Path, compile_decode: bool = False) -> WorkerSettings:
    """The engine process's settings; it compiles its decode graphs (tens of seconds
    the first time) only in the test that compares it with the eager engine thread."""
    return WorkerSettings(
        redis=RedisSettings(url="redis://127.0.0.1:1"),
        model=model_location(model_dir=str(model_dir)),
        worker_id="w-host",
        device="cpu",
        dtype="float32",
        kv_cache_bytes=KV_CACHE_BYTES,
        compile_decode=compile_decode,
    )


def _plans() -> list[StepPlan]:
    admit = StepPlan(
        "w-host",
        1,
        0,
        new_requests=[RequestSpec("r", len(PROMPT), GREEDY, gateway_id="gw")],
        prefill_chunks=[PrefillChunk("r", PROMPT, 0)],
        block_grants={"r": list(range(len(PROMPT) + GREEDY.max_tokens))},
    )
    decodes = [StepPlan("w-host", 1, step, decode_request_ids=["r"]) for step in (1, 2, 3)]
    return [admit, *decodes]


async def _run(host: EngineProcess | EngineThread) -> list[StepDone]:
    stop = asyncio.Event()
    done: asyncio.Queue[StepDone | None] = asyncio.Queue()
    await host.start()
    for index, plan in enumerate(_plans()):
        host.submit(PlanJob(f"{index}-0".encode(), plan, time.time()))
    host.close()
    await host.run(stop, done)
    items = []
    while (item := done.get_nowait()) is not None:
        items.append(item)
    return items


def test_the_engine_process_runs_plans_as_the_engine_thread_does(model_dir: Path) -> None:
    process = EngineProcess(_settings(model_dir, compile_decode=True))
    by_process = asyncio.run(_run(process))
    model = load_model(model_dir, device="cpu", dtype="float32")
    engine = Engine(model, KVCacheBudget(num_bytes=KV_CACHE_BYTES), "cpu", worker_id="w-host")
    by_thread = asyncio.run(_run(EngineThread(engine, "w-host")))
    tokens = [[(t.index, t.token_id) for t in item.batches["gw"]] for item in by_process]
    assert tokens == [[(t.index, t.token_id) for t in item.batches["gw"]] for item in by_thread]
    assert [index for [(index, _)] in tokens] == [0, 1, 2, 3]
    assert by_process[-1].batches["gw"][0].finish_reason == "length"
    # The compiling engine holds back the blocks of its start-up checks.
    held_back = held_back_blocks(model, engine.block_size)
    assert process.num_blocks == engine.num_blocks - held_back and process.num_in_flight == 0
    # The shell's copy of the engine's counters follows every step, and its paths
    # are told from the start (it serves while compiling).
    assert process.stats.num_steps == 4 and process.stats.num_tokens == len(PROMPT) + 3
    assert "eager" in process.stats.live_paths


def test_an_engine_process_that_dies_ends_the_worker(model_dir: Path) -> None:
    async def scenario() -> None:
        host = EngineProcess(_settings(model_dir))
        await host.start()
        done: asyncio.Queue[StepDone | None] = asyncio.Queue()
        running = asyncio.create_task(host.run(asyncio.Event(), done))
        pid = host._process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineProcessDied):
            await asyncio.wait_for(running, timeout=20)
        assert done.get_nowait() is None  # the publisher is told it is over

    asyncio.run(scenario())


def test_a_cancelled_host_still_ends_its_engine_process(model_dir: Path) -> None:
    # Redis gone for good cancels every task of the worker at once, in no set
    # order: the host's own end must tell the engine to stop even when the plan
    # reader's ``close`` comes after it (then a no-op), or the shell's exit
    # would wait on the engine process forever.
    async def scenario() -> int | None:
        host = EngineProcess(_settings(model_dir))
        await host.start()
        running = asyncio.create_task(host.run(asyncio.Event(), asyncio.Queue()))
        await asyncio.sleep(0.1)
        running.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await running
        host.close()  # the plan reader's end, last
        assert time.monotonic() - started < ENGINE_EXIT_WAIT_S / 2
        return host._process.exitcode

    assert asyncio.run(scenario()) == 0  # it ended by itself, not killed


def test_a_shell_that_exits_without_stopping_its_engine_does_not_wait_for_it(
    model_dir: Path,
) -> None:
    # The engine ignores SIGTERM (the shell decides when it stops), so
    # multiprocessing's exit handler, which sends SIGTERM to daemon children and
    # then joins them with no limit, must not be the last word.
    shell_code = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from gpu_worker.engine_host import EngineProcess\n"
        "from tests.gpu_worker.test_engine_host import _settings\n"
        "host = EngineProcess(_settings(Path(sys.argv[1])))\n"
        "asyncio.run(host.start())\n"
        "print('engine pid', host._process.pid, flush=True)\n"
    )
    shell = subprocess.run(
        [sys.executable, "-c", shell_code, str(model_dir)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert shell.returncode == 0, shell.stderr
    [engine_pid] = re.findall(r"^engine pid (\d+)$", shell.stdout, re.MULTILINE)
    assert "engine_process_killed" in shell.stdout + shell.stderr
    assert not Path(f"/proc/{engine_pid}").exists()


def test_a_model_that_does_not_load_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(EngineProcessDied, match="did not start"):
        asyncio.run(EngineProcess(_settings(broken)).start())


def test_the_child_environment_adds_defaults_without_overriding(monkeypatch) -> None:
    monkeypatch.setenv("ORCAPOD_TEST_SET", "mine")
    monkeypatch.delenv("ORCAPOD_TEST_UNSET", raising=False)
    with _child_environment({"ORCAPOD_TEST_SET": "default", "ORCAPOD_TEST_UNSET": "x"}):
        assert os.environ["ORCAPOD_TEST_SET"] == "mine"
        assert os.environ["ORCAPOD_TEST_UNSET"] == "x"
    assert "ORCAPOD_TEST_UNSET" not in os.environ


def test_the_engine_spins_briefly_at_barriers_unless_told_how_to_wait() -> None:
    assert engine_environment_defaults({}) == {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}
    assert engine_environment_defaults({"PATH": "/bin"}) == {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}
    # An operator's choice wins, whichever variable says it (libgomp lets
    # GOMP_SPINCOUNT override OMP_WAIT_POLICY, so neither is added to the other).
    assert engine_environment_defaults({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert engine_environment_defaults({"GOMP_SPINCOUNT": "0"}) == {}


def test_a_plan_bigger_than_the_pipe_does_not_stall_the_loop_while_the_engine_is_busy(
    model_dir: Path,
) -> None:
    # The engine process is stopped (as if in a long step): nothing reads the
    # pipe. A plan of several MB must still leave the event loop free at once.
    big = StepPlan("w-host", 1, 0, released_request_ids=[f"gone-{i:08d}" for i in range(200_000)])

    async def scenario() -> tuple[float, float, list[StepDone]]:
        host = EngineProcess(_settings(model_dir))
        await host.start()
        pid = host._process.pid
        assert pid is not None
        done: asyncio.Queue[StepDone | None] = asyncio.Queue()
        running = asyncio.create_task(host.run(asyncio.Event(), done))
        os.kill(pid, signal.SIGSTOP)
        # Were the write on the loop, it would wait for the engine forever: a
        # watchdog lets the engine go on after 2 s, so that fails, not hangs.
        watchdog = threading.Timer(2.0, os.kill, (pid, signal.SIGCONT))
        watchdog.start()
        try:
            started = time.perf_counter()
            host.submit(PlanJob(b"0-0", big, time.time()))
            submit_s = time.perf_counter() - started
            started = time.perf_counter()
            await asyncio.sleep(0.2)  # the rest of the plan waits for room meanwhile
            sleep_s = time.perf_counter() - started
        finally:
            watchdog.cancel()
            os.kill(pid, signal.SIGCONT)
        host.close()
        await asyncio.wait_for(running, timeout=60)
        items = []
        while (item := done.get_nowait()) is not None:
            items.append(item)
        return submit_s, sleep_s, items

    submit_s, sleep_s, items = asyncio.run(scenario())
    assert submit_s < 0.5 and sleep_s < 0.5
    # The engine read it once it went on: a release of unknown ids is a no-op step.
    assert [item.entry_id for item in items] == [b"0-0"]
