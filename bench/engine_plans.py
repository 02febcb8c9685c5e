"""The plans a benchmark hands ``Engine.step`` directly (no scheduler): prefill, release,
rewind, and filling an engine with requests a few at a time.

The blocks a plan writes are granted by ``gpu_worker.local_blocks`` as the scheduler would.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gpu_worker.local_blocks import step_alone
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan

if TYPE_CHECKING:
    from gpu_worker.engine import Engine

BLOCK_SIZE = 16
FILL_GROUP = 8  # requests per prefill step while filling an engine
# Never ends on its own: a benchmark decides how many steps a request runs.
SAMPLING = SamplingParams(max_tokens=1 << 30, ignore_eos=True)


def prefill_plan(prompts: dict[str, list[int]]) -> StepPlan:
    """Admit every prompt and prefill it whole in one step."""
    return StepPlan(
        worker_id="bench",
        epoch=0,
        step_index=0,
        new_requests=[RequestSpec(rid, len(ids), SAMPLING) for rid, ids in prompts.items()],
        prefill_chunks=[PrefillChunk(rid, ids, 0) for rid, ids in prompts.items()],
    )


def release_plan(request_ids: list[str]) -> StepPlan:
    """Release ``request_ids`` (an unknown one is no error)."""
    return StepPlan(worker_id="bench", epoch=0, step_index=0, released_request_ids=request_ids)


def decode_plan(request_ids: list[str]) -> StepPlan:
    """One decode step of ``request_ids``."""
    return StepPlan(worker_id="bench", epoch=0, step_index=0, decode_request_ids=request_ids)


def rewind(engine: Engine, request_ids: list[str], num_cached_tokens: int) -> None:
    """Set each request's cached tokens back to ``num_cached_tokens``: the next decode
    rewrites the same slot and attends exactly as many tokens. (Re-prefilling 64
    requests costs ~40 s.)"""
    for request_id in request_ids:
        engine._requests[request_id].num_cached_tokens = num_cached_tokens


def prefill_in_groups(engine: Engine, prompts: dict[str, list[int]]) -> list[tuple[float, int]]:
    """Admit and prefill ``prompts``, ``FILL_GROUP`` a step; each step's seconds and
    number of requests."""
    request_ids = list(prompts)
    steps = []
    for start in range(0, len(request_ids), FILL_GROUP):
        group = request_ids[start : start + FILL_GROUP]
        plan = prefill_plan({rid: prompts[rid] for rid in group})
        started = time.perf_counter()
        step_alone(engine, plan)
        steps.append((time.perf_counter() - started, len(group)))
    return steps
