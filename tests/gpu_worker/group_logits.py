"""A worker group's logits of a mixed step against one engine's: the group's ranks
started as the worker starts them (``join_group``: their stage's layers, their
tensor share, gloo), one step of two prompts and a one-token continuation run
through the stages with the worker's own sends (``StageLink``), every row's
logits taken at the last stage's leader; one engine of the same weights runs
the same step whole.

``python -m tests.gpu_worker.group_logits MODEL_DIR P T [P T ...]`` prints a
JSON line per group: the largest difference from one engine's logits, over the
largest logit (the number docs/performance.md records for SmolLM2).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import sys
from pathlib import Path

import torch

from gpu_worker.attention import default_backend_name
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.model_loading import load_model
from gpu_worker.pipeline_layout import free_local_port
from gpu_worker.pipeline_messages import StageStep
from gpu_worker.pipeline_stage import PipelineStage
from gpu_worker.pipeline_stage_loop import pass_through_stage
from gpu_worker.step_path import StepInputs, StepPiece
from gpu_worker.worker_group import join_group
from shared.settings import WorkerSettings
from tests.gpu_worker.test_engine_host import _settings as engine_settings

BLOCK_SIZE = 16
# Each piece's request, tokens and first position: two prompts in one step and a
# request already 20 tokens in (its earlier K/V blocks empty: the same on both sides).
PIECES = [("a", 23, 0), ("b", 9, 0), ("c", 1, 20)]
RANK_TIMEOUT_S = 120.0


def _step(kv_cache: PagedKVCache, vocab_size: int) -> StepInputs:
    """The step of ``PIECES`` (seeded token ids), every row's logits wanted."""
    generator = torch.Generator().manual_seed(7)
    pieces = []
    next_block = 0
    for request_id, num_tokens, start in PIECES:
        num_blocks = -(-(start + num_tokens) // BLOCK_SIZE)
        kv_cache.tables.extend(request_id, range(next_block, next_block + num_blocks))
        next_block += num_blocks
        token_ids = torch.randint(vocab_size, (num_tokens,), generator=generator).tolist()
        pieces.append(StepPiece(request_id, token_ids, start, True))
    inputs = StepInputs.flatten(kv_cache, pieces)
    return dataclasses.replace(inputs, logits_rows=list(range(len(inputs.token_ids))))


def _settings(model_dir: Path, num_stages: int, tensor_parallel: int, port: int) -> WorkerSettings:
    """The engine process's settings (``test_engine_host.py``'s), as a group meeting at ``port``."""
    return dataclasses.replace(
        engine_settings(model_dir),
        worker_id="w-logits",
        kv_cache_bytes=64 * 2**20,
        block_size=BLOCK_SIZE,
        weight_format="auto",
        pipeline_parallel=num_stages,
        tensor_parallel=tensor_parallel,
        rendezvous=f"127.0.0.1:{port}",
        rendezvous_timeout_s=RANK_TIMEOUT_S,
    )


def _rank(settings: WorkerSettings, rank: int, results: multiprocessing.Queue) -> None:
    """One rank: its share of the step; the last stage's leader puts the logits."""
    member = join_group(settings, rank)
    model, link = member.model, member.link
    kv_cache = PagedKVCache(
        model.config, member.kv_size.num_blocks, BLOCK_SIZE, model.device, model.dtype
    )
    samples_here = member.last and link.is_leader
    backend = default_backend_name(model.device)
    stage = PipelineStage(model, kv_cache, backend, first=member.first, last=samples_here)
    # Every row's logits: the step as the first stage would send it, all rows sampled.
    step = StageStep(0, _step(kv_cache, model.config.vocab_size), [])
    passed = pass_through_stage(member, stage, step)
    link.wait_sent()
    if samples_here:
        assert passed.output is not None, "the group's forward failed (see the log)"
        results.put(passed.output.numpy())
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def group_logits(model_dir: Path, num_stages: int, tensor_parallel: int) -> torch.Tensor:
    """Every row's logits of the step, computed by a group of P x T ranks."""
    settings = _settings(model_dir, num_stages, tensor_parallel, free_local_port())
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=_rank, args=(settings, rank, results))
        for rank in range(num_stages * tensor_parallel)
    ]
    for process in ranks:
        process.start()
    try:
        logits = torch.from_numpy(results.get(timeout=RANK_TIMEOUT_S))
        for process in ranks:
            process.join(timeout=RANK_TIMEOUT_S)
        assert [process.exitcode for process in ranks] == [0] * len(ranks)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
    return logits


def engine_logits(model_dir: Path) -> torch.Tensor:
    """The same step's logits on one engine of the same (default) weights."""
    model = load_model(model_dir, "cpu", "float32", "auto")
    kv_cache = PagedKVCache(model.config, 16, BLOCK_SIZE, model.device, model.dtype)
    stage = PipelineStage(model, kv_cache, default_backend_name(model.device), True, True)
    return stage.forward(_step(kv_cache, model.config.vocab_size), None)


def relative_error(logits: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest difference over the largest logit."""
    return float((logits - exact).abs().max() / exact.abs().max())


def main(argv: list[str]) -> None:
    model_dir, *splits = argv
    exact = engine_logits(Path(model_dir))
    for num_stages, tensor_parallel in zip(splits[::2], splits[1::2], strict=True):
        logits = group_logits(Path(model_dir), int(num_stages), int(tensor_parallel))
        record = {
            "pipeline_parallel": int(num_stages),
            "tensor_parallel": int(tensor_parallel),
            "max_logit_error": relative_error(logits, exact),
            "same_argmax_rows": int((logits.argmax(-1) == exact.argmax(-1)).sum()),
            "rows": len(exact),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
