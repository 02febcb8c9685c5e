"""Drive an Engine the way a scheduler would, for tests: staggered joins, chunked prefill."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.engine import Engine
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepOutput, StepPlan


@dataclass
class Job:
    """A request to run: its prompt, when it joins (step index) and its chunk size."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    join_step: int = 0
    chunk_size: int = 1 << 30
    generated_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prefilled: int = 0
    admitted: bool = False


def run_jobs(engine: Engine, jobs: list[Job], max_steps: int = 10_000) -> list[StepOutput]:
    """Step the engine until every job finishes; each step mixes prefill chunks and decodes."""
    outputs: list[StepOutput] = []
    for step_index in range(max_steps):
        if all(job.finish_reason for job in jobs):
            return outputs
        new_requests, chunks, decodes = [], [], []
        for job in jobs:
            if job.finish_reason or job.join_step > step_index:
                continue
            if not job.admitted:
                new_requests.append(RequestSpec(job.request_id, len(job.prompt_ids), job.sampling))
                job.admitted = True
            if job.num_prefilled < len(job.prompt_ids):
                end = min(len(job.prompt_ids), job.num_prefilled + job.chunk_size)
                chunks.append(
                    PrefillChunk(
                        job.request_id, job.prompt_ids[job.num_prefilled : end], job.num_prefilled
                    )
                )
                job.num_prefilled = end
            else:
                decodes.append(job.request_id)
        output = engine.step(
            StepPlan(
                worker_id="test",
                epoch=0,
                step_index=step_index,
                new_requests=new_requests,
                prefill_chunks=chunks,
                decode_request_ids=decodes,
            )
        )
        outputs.append(output)
        by_id = {job.request_id: job for job in jobs}
        for token in output.tokens:
            job = by_id[token.request_id]
            assert token.index == len(job.generated_ids)
            job.generated_ids.append(token.token_id)
            job.finish_reason = token.finish_reason
    raise AssertionError("jobs did not finish")
