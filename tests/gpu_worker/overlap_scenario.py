"""Overlapping chats against the same chats alone, on the real SmolLM2, driven by the
real scheduler core: the differential check of every step path a worker takes.

Ten greedy chats that share a system prompt arrive staggered over two workers
whose K/V pools are too small for all of them at once, with a small token
budget. So the plans hold, as in the service: joins while others decode
(mixed steps, prompts in chunks), batches growing from one request to ten
and shrinking back (both sides of int4's 8 rows and of the paged attention's
16 blocks), preemptions and their recompute, prefix-cache hits on the
shared system prompt, and plans alternating between two engines. Each
chat's tokens must equal its tokens when it runs alone on a fresh engine of
the same kind: whatever path a step took, the answer is the request's own.

``python -m tests.gpu_worker.overlap_scenario MODEL_DIR FORMAT COMPILE`` runs
it in a process of its own (so ``ATEN_CPU_CAPABILITY`` can hold it to AVX2)
and prints a JSON line: the paths each run took and the chats that differ.
"""

from __future__ import annotations

import collections
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gateway.tokenizer import ChatTokenizer
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.llama import LlamaModel
from gpu_worker.model_loading import load_model, prompt_logits
from gpu_worker.path_compiler import held_back_blocks
from gpu_worker.quantized_linear import weight_format_of
from scheduler_actor.config import SchedulerConfig
from scheduler_actor.core import Scheduler
from shared.messages import SamplingParams

SYSTEM = "You are a helpful assistant. Answer in one or two short sentences."
QUESTIONS = [
    "Write a poem about the sea.",
    "Why is the sky blue?",
    "Count to ten.",
    "What is a compiler?",
    "Name three fruits.",
    "What is the capital of France?",
    "How do plants make food?",
    "What is rain?",
    "Say hello in Spanish.",
    "What does a baker do?",
]
MAX_TOKENS = 24
BLOCK_SIZE = 16
# Per worker: fewer than ten chats hold at once, so that some are preempted and
# recomputed.
NUM_BLOCKS = 20
WORKERS = ("w0", "w1")


@dataclass
class Outcome:
    """Each chat's tokens, and how many steps took each path."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    paths: collections.Counter[str] = field(default_factory=collections.Counter)
    num_preemptions: int = 0
    num_cached_tokens: int = 0


def prompts(tokenizer: ChatTokenizer) -> dict[str, list[int]]:
    """The ten chats' prompts, by request id."""
    return {
        f"chat{index}": tokenizer.encode_chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        )
        for index, question in enumerate(QUESTIONS)
    }


def engine_for(model: LlamaModel, compile_decode: bool, worker_id: str) -> Engine:
    """NUM_BLOCKS to grant (and those the compiled paths' checks hold back)."""
    held_back = held_back_blocks(model, BLOCK_SIZE) if compile_decode else 0
    budget = KVCacheBudget(
        num_bytes=(NUM_BLOCKS + held_back) * bytes_per_block(model.config, BLOCK_SIZE, model.dtype),
        block_size=BLOCK_SIZE,
    )
    return Engine(model, budget, "cpu", worker_id=worker_id, compile_decode=compile_decode)


def run(
    engines: dict[str, Engine],
    chats: dict[str, list[int]],
    stagger_steps: int,
    ignore_eos: bool = True,
) -> Outcome:
    """``chats`` submitted one every ``stagger_steps`` plans, served by the scheduler
    core over ``engines`` (one plan in flight each) until all are done."""
    config = SchedulerConfig(max_batch_size=16, token_budget=48, max_chunk_tokens=32)
    scheduler = Scheduler(config, lambda: 0.0)
    for worker_id, engine in engines.items():
        scheduler.worker_joined(worker_id, engine.num_blocks, engine.block_size, 1)
    outcome = Outcome()
    waiting = list(chats.items())
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=ignore_eos)
    for step in range(5000):
        if waiting and step % stagger_steps == 0:
            request_id, prompt_ids = waiting.pop(0)
            scheduler.submit(request_id, "tenant", prompt_ids, sampling)
        for worker_id, engine in engines.items():
            plan = scheduler.next_plan(worker_id)
            if plan is None:
                continue
            outcome.num_cached_tokens += sum(s.num_cached_tokens for s in plan.new_requests)
            output = engine.step(plan)
            if output.num_new_tokens:
                outcome.paths[output.path] += 1
            for finished in scheduler.on_result(output):
                assert finished.finish_reason in ("stop", "length"), finished
                outcome.tokens[finished.request_id] = finished.token_ids
                outcome.num_preemptions += finished.num_preemptions
        if not waiting and len(outcome.tokens) == len(chats):
            return outcome
    raise AssertionError(f"the chats did not finish: {sorted(outcome.tokens)} of {sorted(chats)}")


def compare(model: LlamaModel, chats: dict[str, list[int]], compile_decode: bool) -> dict:
    """Every chat alone (one engine, nothing else running), then all of them at once
    on that engine (batches of up to ten, a pool too small for all: preemptions),
    then staggered over it and a second engine: the chats whose tokens differ from
    their lone run, and the paths each run took."""
    first = engine_for(model, compile_decode, WORKERS[0])
    alone = Outcome()
    for request_id, prompt_ids in chats.items():
        one = run({WORKERS[0]: first}, {request_id: prompt_ids}, stagger_steps=1)
        alone.tokens.update(one.tokens)
        alone.paths.update(one.paths)
    crowded = run({WORKERS[0]: first}, chats, stagger_steps=1)
    second = engine_for(model, compile_decode, WORKERS[1])
    spread = run({WORKERS[0]: first, WORKERS[1]: second}, chats, stagger_steps=2)
    return {
        "weight_format": weight_format_of(model.weights),
        "compile_decode": compile_decode,
        "planned_paths": first.paths.planned(),
        "runs": {
            name: {
                "paths": dict(outcome.paths),
                "num_preemptions": outcome.num_preemptions,
                "num_cached_tokens": outcome.num_cached_tokens,
                "differing": {
                    request_id: {"alone": alone.tokens[request_id], "overlapping": tokens}
                    for request_id, tokens in outcome.tokens.items()
                    if tokens != alone.tokens[request_id]
                },
            }
            for name, outcome in {
                "alone": alone,
                "one worker": crowded,
                "two workers": spread,
            }.items()
        },
    }


def divergence_margins(
    exact: LlamaModel, chats: dict[str, list[int]], differing: dict[str, dict[str, list[int]]]
) -> dict[str, float]:
    """For each chat of ``differing`` (its ``alone`` and ``overlapping`` tokens), how
    close the two tokens where they part were for ``exact``: the difference of
    its logits for them, after the prompt and the tokens they share. A path that
    rounds coarser than fp32 (int4's bf16) may part there only at a near-tie."""
    margins = {}
    for request_id, runs in differing.items():
        alone, overlapping = runs["alone"], runs["overlapping"]
        shared = next(
            (i for i, (a, b) in enumerate(zip(alone, overlapping, strict=False)) if a != b),
            min(len(alone), len(overlapping)),
        )
        if shared == min(len(alone), len(overlapping)):
            margins[request_id] = float("inf")  # one ended early: not a tie
            continue
        logits = prompt_logits(exact, chats[request_id] + alone[:shared])[-1]
        margins[request_id] = abs(float(logits[alone[shared]] - logits[overlapping[shared]]))
    return margins


def main(argv: list[str]) -> int:
    model_dir, weight_format, compile_decode = Path(argv[0]), argv[1], argv[2] == "1"
    tokenizer = ChatTokenizer.from_model_dir(model_dir)
    model = load_model(model_dir, device="cpu", dtype="float32", weight_format=weight_format)
    print(json.dumps(compare(model, prompts(tokenizer), compile_decode)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
