"""Drive an Engine the way a scheduler would, for tests: staggered joins, chunked prefill."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gpu_worker.engine import Engine
from gpu_worker.local_blocks import step_alone
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


def grants_up_front(specs: list[RequestSpec], first_block: int = 0) -> dict[str, list[int]]:
    """Disjoint blocks for each request's prompt and max_tokens, one per token
    (enough at any block size): what a scheduler would grant over its life,
    for plans sent to a worker by hand."""
    grants, next_block = {}, first_block
    for spec in specs:
        count = spec.num_prompt_tokens + spec.sampling.max_tokens
        grants[spec.request_id] = list(range(next_block, next_block + count))
        next_block += count
    return grants


def random_jobs(
    seed: int,
    num_jobs: int,
    vocab_size: int,
    max_prompt_tokens: int,
    max_tokens: tuple[int, int],
    max_join_step: int,
    chunk_sizes: tuple[int, ...],
) -> list[Job]:
    """Greedy jobs with random prompts (ids 3.. below ``vocab_size``), answer lengths in
    ``max_tokens`` [low, high), joins in [0, max_join_step) and chunk sizes; the same
    jobs for the same seed."""
    rng = random.Random(seed)
    return [
        Job(
            request_id=f"r{i}",
            prompt_ids=[
                rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, max_prompt_tokens))
            ],
            sampling=SamplingParams(
                max_tokens=rng.randrange(*max_tokens), temperature=0.0, ignore_eos=True
            ),
            join_step=rng.randrange(0, max_join_step),
            chunk_size=rng.choice(chunk_sizes),
        )
        for i in range(num_jobs)
    ]


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
        output = step_alone(
            engine,
            StepPlan(
                worker_id="test",
                epoch=0,
                step_index=step_index,
                new_requests=new_requests,
                prefill_chunks=chunks,
                decode_request_ids=decodes,
            ),
        )
        outputs.append(output)
        by_id = {job.request_id: job for job in jobs}
        for token in output.tokens:
            job = by_id[token.request_id]
            assert token.index == len(job.generated_ids)
            job.generated_ids.append(token.token_id)
            job.finish_reason = token.finish_reason
    raise AssertionError("jobs did not finish")
