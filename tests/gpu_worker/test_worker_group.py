"""A worker group (pipeline stages of tensor-parallel ranks) over torch.distributed
(gloo), as the worker runs it: its answers are one engine's, token for token,
with plans in flight in every stage; a group that cannot be made is refused at
start on every rank; a rank that dies ends the group, and no rank waits for ever."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from gateway.tokenizer import ChatTokenizer
from gpu_worker import worker_group
from gpu_worker.engine import Engine
from gpu_worker.engine_host import EngineProcess, EngineProcessDied, EngineThread, PlanJob
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.model_config import load_model_config
from gpu_worker.model_loading import load_model
from gpu_worker.pipeline_layout import GroupConfigError, free_local_port, stage_layer_ranges
from gpu_worker.pipeline_link import data_backend
from gpu_worker.step_done import StepDone
from gpu_worker.worker_group import _stage_budget, rank_device
from scheduler_actor.config import SchedulerConfig
from scheduler_actor.core import Scheduler
from shared.messages import SamplingParams
from shared.settings import WorkerSettings, default_kv_cache_fraction
from tests.gpu_worker import overlap_scenario
from tests.gpu_worker.test_engine_host import KV_CACHE_BYTES, _plans, _run, _settings
from tests.gpu_worker.tiny_models import write_tiny_model

REPO = Path(__file__).parents[2]
TINY_LAYERS = 4
# K/V blocks of the SmolLM2 group: fewer than its four chats need at once.
GROUP_POOL_BLOCKS = 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama whose 4 layers, 4 heads, 2 K/V heads and 160 MLP units split
    over 2 or 3 stages and 2 tensor ranks."""
    directory = tmp_path_factory.mktemp("tiny") / "llama"
    return write_tiny_model(directory, "llama", num_hidden_layers=TINY_LAYERS)


def _group(model_dir: Path, num_stages: int, **changes: object) -> WorkerSettings:
    """The engine process's settings (``test_engine_host.py``'s), as a group."""
    settings = _settings(model_dir)
    group = {"worker_id": "w-group", "rendezvous_timeout_s": 30.0, **changes}
    return dataclasses.replace(settings, pipeline_parallel=num_stages, **group)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    return status != "Z"


@pytest.mark.parametrize(
    ("num_stages", "tensor_parallel"),
    [(2, 1), (3, 1), (1, 2), (2, 2)],
    ids=["P2", "P3", "T2", "P2xT2"],
)
def test_a_group_runs_plans_as_one_engine_does(
    tiny_dir: Path, num_stages: int, tensor_parallel: int
) -> None:
    # The plans overlap (each decode is sent before the step before it is done), so
    # the first stage must wait for the last one's sample before it begins the next.
    # Three stages: the middle one passes plans and hidden states on.
    group = EngineProcess(_group(tiny_dir, num_stages, tensor_parallel=tensor_parallel))
    by_group = asyncio.run(_run(group))
    # One engine of the same (default) weights as the group's ranks.
    model = load_model(tiny_dir, device="cpu", dtype="float32", weight_format="auto")
    engine = Engine(model, KVCacheBudget(num_bytes=KV_CACHE_BYTES), "cpu", worker_id="w-host")
    by_engine = asyncio.run(_run(EngineThread(engine, "w-host")))
    tokens = [[(t.index, t.token_id) for t in item.batches["gw"]] for item in by_group]
    assert tokens == [[(t.index, t.token_id) for t in item.batches["gw"]] for item in by_engine]
    assert [index for [(index, _)] in tokens] == [0, 1, 2, 3]
    assert by_group[-1].batches["gw"][0].finish_reason == "length"
    assert [item.output.path for item in by_group if item.output] == ["pipeline"] * 4
    assert group.stats.live_paths == ["pipeline"] and group.stats.num_steps == 4
    # Each rank holds a share of the layers or heads: more blocks in the same bytes,
    # as many as the rank with the most layers holds.
    most_layers = max(len(r) for r in stage_layer_ranges(TINY_LAYERS, num_stages))
    assert group.num_blocks == TINY_LAYERS // most_layers * tensor_parallel * engine.num_blocks
    assert all(not process.is_alive() for process in group._stage_processes)


async def _serve_chats(
    host: EngineProcess, num_stages: int, chats: dict[str, list[int]]
) -> tuple[dict[str, list[int]], int, int]:
    """The chats through the scheduler core, one joining per answer, over the group as
    the service runs it (one plan per stage in flight); each chat's tokens and the
    most plans seen in flight at once."""
    config = SchedulerConfig(max_batch_size=16, token_budget=48, max_chunk_tokens=32)
    scheduler = Scheduler(config, lambda: 0.0)
    await host.start()
    scheduler.worker_joined(
        "w-group", host.num_blocks, host.block_size, num_stages, pipeline_depth=num_stages
    )
    done: asyncio.Queue[StepDone | None] = asyncio.Queue()
    running = asyncio.create_task(host.run(asyncio.Event(), done))
    sampling = SamplingParams(
        max_tokens=overlap_scenario.MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    waiting = list(chats.items())
    tokens: dict[str, list[int]] = {}
    in_flight: dict[int, set[str]] = {}
    most_in_flight = num_preemptions = 0
    while len(tokens) < len(chats):
        if waiting:
            request_id, prompt_ids = waiting.pop(0)
            scheduler.submit(request_id, "tenant", prompt_ids, sampling)
        while (plan := scheduler.next_plan("w-group")) is not None:
            named = {*plan.decode_request_ids, *(c.request_id for c in plan.prefill_chunks)}
            for others in in_flight.values():
                assert not named & others, "a request in two plans in flight at once"
            in_flight[plan.step_index] = named
            most_in_flight = max(most_in_flight, len(in_flight))
            host.submit(PlanJob(str(plan.step_index).encode(), plan, time.time()))
        item = await asyncio.wait_for(done.get(), timeout=120)
        assert item is not None and item.output is not None and item.dead_error is None
        del in_flight[item.output.step_index]
        for finished in scheduler.on_result(item.output):
            assert finished.finish_reason == "length", finished
            tokens[finished.request_id] = finished.token_ids
            num_preemptions += finished.num_preemptions
    host.close()
    await asyncio.wait_for(running, timeout=30)
    return tokens, most_in_flight, num_preemptions


@pytest.fixture(scope="module")
def chats(prepared_model_dir: Path) -> dict[str, list[int]]:
    tokenizer = ChatTokenizer.from_model_dir(prepared_model_dir)
    return dict(list(overlap_scenario.prompts(tokenizer).items())[:4])


@pytest.fixture(scope="module")
def alone(prepared_model_dir: Path, chats: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each chat alone on one engine of the worker's default weights (eager)."""
    model = load_model(prepared_model_dir, device="cpu", dtype="float32", weight_format="auto")
    engine = overlap_scenario.engine_for(model, compile_decode=False, worker_id="w0")
    tokens = {}
    for request_id, prompt_ids in chats.items():
        one = overlap_scenario.run({"w0": engine}, {request_id: prompt_ids}, stagger_steps=1)
        tokens.update(one.tokens)
    return tokens


def test_staggered_chats_on_a_group_answer_as_each_alone(
    prepared_model_dir: Path,
    chats: dict[str, list[int]],
    alone: dict[str, list[int]],
) -> None:
    # SmolLM2 with the worker's default weights on this CPU, its 30 layers in 2 stages
    # of 3 tensor ranks (its 9 heads, 3 K/V heads and 1,536 MLP units split in 3),
    # six processes in all; chats join
    # while others decode (mixed steps, prompts in chunks), the pool too small for
    # all of them (preemptions), and the scheduler keeps one plan per stage in
    # flight, so each stage works on its own batch. Tensor ranks add partial sums in
    # another order than one matrix product: the logits differ by rounding, and the
    # greedy answers must still be the same.
    num_stages, tensor_parallel = 2, 3
    config = load_model_config(prepared_model_dir)
    pool_bytes = GROUP_POOL_BLOCKS * bytes_per_block(
        config, overlap_scenario.BLOCK_SIZE, torch.float32
    )
    settings = _group(
        prepared_model_dir,
        num_stages,
        weight_format="auto",
        kv_cache_bytes=pool_bytes // (num_stages * tensor_parallel),
        block_size=overlap_scenario.BLOCK_SIZE,
        tensor_parallel=tensor_parallel,
    )
    host = EngineProcess(settings)
    by_group, most_in_flight, num_preemptions = asyncio.run(_serve_chats(host, num_stages, chats))
    assert host.num_blocks == GROUP_POOL_BLOCKS and num_preemptions >= 1
    assert most_in_flight == num_stages
    assert by_group == alone


@pytest.mark.parametrize(
    ("num_stages", "tensor_parallel", "message"),
    [
        (5, 1, "5 is more stages than the model's 4 layers"),
        (1, 3, "--tensor-parallel 3 does not divide the model's 4 attention heads"),
    ],
)
def test_a_group_the_model_cannot_take_is_refused_on_every_rank(
    tiny_dir: Path, num_stages: int, tensor_parallel: int, message: str
) -> None:
    group = EngineProcess(_group(tiny_dir, num_stages, tensor_parallel=tensor_parallel))
    with pytest.raises(EngineProcessDied, match=message):
        asyncio.run(group.start())
    for process in group._stage_processes:
        process.join(10)
        assert process.exitcode == 1


def test_a_rank_that_never_comes_is_named(tiny_dir: Path) -> None:
    settings = _group(
        tiny_dir,
        2,
        group_rank=0,
        rendezvous=f"127.0.0.1:{free_local_port()}",
        rendezvous_timeout_s=2.0,
        local_ranks=1,
    )
    started = time.monotonic()
    with pytest.raises(EngineProcessDied, match=r"ranks \[1\] of the group's 2 never joined"):
        asyncio.run(EngineProcess(settings).start())
    assert time.monotonic() - started < 30


def _rank_elsewhere(rank: int, rendezvous: str, model_dir: Path) -> subprocess.Popen[str]:
    """A rank as another host runs it: `python -m gpu_worker --group-rank N`, no Redis."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "gpu_worker", "--pipeline-parallel", "2", "--group-rank",
            str(rank), "--rendezvous", rendezvous, "--model", str(model_dir), "--device", "cpu",
            "--dtype", "float32", f"--kv-cache-bytes={KV_CACHE_BYTES}", "--local-ranks", "2",
        ],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_rank_started_on_its_own_joins_the_group_and_ends_with_it(tiny_dir: Path) -> None:
    rendezvous = f"127.0.0.1:{free_local_port()}"
    rank1 = _rank_elsewhere(1, rendezvous, tiny_dir)
    settings = _group(tiny_dir, 2, group_rank=0, rendezvous=rendezvous, local_ranks=2)
    try:
        by_group = asyncio.run(_run(EngineProcess(settings)))
        _, stderr = rank1.communicate(timeout=60)
    finally:
        rank1.kill()
    tokens = [[t.token_id for t in item.batches["gw"]] for item in by_group]
    assert len(tokens) == 4 and all(len(step) == 1 for step in tokens)
    assert rank1.returncode == 0, stderr
    assert '"group_rank_stopped"' in stderr


def test_ranks_that_load_different_models_are_refused(tiny_dir: Path, tmp_path: Path) -> None:
    # Rank 1 "on another host" loads another checkpoint of the same shape: the same
    # but for its final norm.
    other = write_tiny_model(tmp_path / "other", "llama", num_hidden_layers=TINY_LAYERS)
    [weights_file] = other.glob("*.safetensors")
    tensors = safetensors.torch.load_file(weights_file)
    tensors["model.norm.weight"] += 0.5
    safetensors.torch.save_file(tensors, weights_file, metadata={"format": "pt"})
    rendezvous = f"127.0.0.1:{free_local_port()}"
    rank1 = _rank_elsewhere(1, rendezvous, other)
    settings = _group(tiny_dir, 2, group_rank=0, rendezvous=rendezvous, local_ranks=2)
    try:
        with pytest.raises(EngineProcessDied, match="rank 1 loaded another model than rank 0"):
            asyncio.run(EngineProcess(settings).start())
        _, stderr = rank1.communicate(timeout=60)
    finally:
        rank1.kill()
    assert rank1.returncode == 1
    assert "rank 1 loaded another model than rank 0" in stderr.splitlines()[-1]


@pytest.mark.parametrize(
    ("num_stages", "tensor_parallel", "killed"),
    [(2, 1, "last stage"), (2, 1, "first stage"), (3, 1, "middle stage"), (1, 2, "tensor peer")],
)
def test_a_killed_rank_ends_the_whole_group(
    tiny_dir: Path, num_stages: int, tensor_parallel: int, killed: str
) -> None:
    async def scenario() -> None:
        host = EngineProcess(_group(tiny_dir, num_stages, tensor_parallel=tensor_parallel))
        await host.start()
        done: asyncio.Queue[StepDone | None] = asyncio.Queue()
        running = asyncio.create_task(host.run(asyncio.Event(), done))
        pids = [host._process.pid, *(process.pid for process in host._stage_processes)]
        assert None not in pids and len(pids) == num_stages * tensor_parallel
        # Ranks: the first stage's is 0, the middle one's 1 of 3, the last one's last.
        victim = {"first stage": 0, "middle stage": 1}.get(killed, len(pids) - 1)
        os.kill(pids[victim], signal.SIGKILL)  # type: ignore[arg-type]
        # A tensor peer's loss shows at the next collective: the next plan's.
        host.submit(PlanJob(b"0-0", _plans()[0], time.time()))
        with pytest.raises(EngineProcessDied):
            await asyncio.wait_for(running, timeout=20)
        assert done.get_nowait() is None
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:  # type: ignore[arg-type]
            await asyncio.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_each_rank_on_cuda_takes_a_gpu_of_its_own_and_the_cpu_shares_its_memory(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The decision alone (no GPU here): NCCL takes one device a rank.
    settings = _group(tiny_dir, 3)
    assert [rank_device(settings, rank) for rank in range(3)] == ["cpu"] * 3
    assert data_backend(torch.device("cpu")) == "gloo"
    assert data_backend(torch.device("cuda", 1)) == "nccl"
    shared_memory = dataclasses.replace(settings, kv_cache_bytes=None)
    cpu_budget = _stage_budget(shared_memory, torch.device("cpu"))
    assert cpu_budget.fraction == pytest.approx(default_kv_cache_fraction("cpu") / 3)
    monkeypatch.setattr(worker_group, "choose_device", lambda name: torch.device(name or "cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    on_cuda = dataclasses.replace(settings, device="cuda", kv_cache_bytes=None)
    assert [rank_device(on_cuda, rank) for rank in range(2)] == ["cuda:0", "cuda:1"]
    with pytest.raises(GroupConfigError, match="rank 2 is rank 2 of this host, which has 2 CUDA"):
        rank_device(on_cuda, 2)
    pinned = dataclasses.replace(on_cuda, device="cuda:1", group_rank=2)
    assert rank_device(pinned, 2) == "cuda:1"
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's word
    assert rank_device(dataclasses.replace(on_cuda, group_rank=2), 2) == "cuda:1"
    cuda_budget = _stage_budget(on_cuda, torch.device("cuda", 0))
    assert cuda_budget.fraction == pytest.approx(default_kv_cache_fraction("cuda"))
