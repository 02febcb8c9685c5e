"""The engine gives a plain model's tokens and logits, whatever shares its batch.

Tiny random checkpoints cover every architectural variant (GQA, Qwen2 biases,
llama3 rope scaling, untied head); the real SmolLM2 is in test_smollm2.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.local_blocks import step_alone
from gpu_worker.model_loading import load_model
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from tests.gpu_worker.plans import Job, run_jobs
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

VARIANTS = ["llama", "qwen2", "llama3_rope", "untied"]


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request, tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return load_model(model_dir, device="cpu", dtype="float32"), reference.eval()


def _hf_greedy(reference, prompt_ids: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = reference(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt_ids) :]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_staggered_chunked_batch_matches_transformers_greedy(tiny, backend):
    model, reference = tiny
    rng = random.Random(7)
    jobs = [
        Job(
            request_id=f"r{i}",
            prompt_ids=[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(rng.randrange(1, 70))],
            sampling=SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True),
            join_step=rng.randrange(0, 8),
            chunk_size=rng.choice([3, 7, 16, 1000]),
        )
        for i in range(8)
    ]
    engine = Engine(model, KVCacheBudget(num_bytes=4 << 20, block_size=4), backend)
    run_jobs(engine, jobs)
    for job in jobs:
        assert job.generated_ids == _hf_greedy(reference, job.prompt_ids, job.sampling.max_tokens)
        assert job.finish_reason == "length"
    assert engine.num_free_blocks == engine.num_blocks


def test_step_logits_match_transformers_within_1e4(tiny):
    """Per-step logits, prefill chunk by chunk then decode, against a full forward."""
    model, reference = tiny
    engine = Engine(model, KVCacheBudget(num_bytes=1 << 20, block_size=4), "cpu")
    prompt = [random.Random(3).randrange(3, TINY_VOCAB_SIZE) for _ in range(23)]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    captured = []
    original_forward = model.forward

    def capture(**kwargs):
        logits = original_forward(**kwargs)
        captured.append(logits)
        return logits

    model.forward = capture  # type: ignore[method-assign]
    try:
        plans = [
            StepPlan(
                "t",
                0,
                0,
                new_requests=[RequestSpec("a", 23, sampling)],
                prefill_chunks=[PrefillChunk("a", prompt[:9], 0)],
            ),
            StepPlan("t", 0, 1, prefill_chunks=[PrefillChunk("a", prompt[9:], 9)]),
        ] + [StepPlan("t", 0, 2 + i, decode_request_ids=["a"]) for i in range(3)]
        tokens = []
        for plan in plans:
            tokens += [t.token_id for t in step_alone(engine, plan).tokens]
    finally:
        del model.forward
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens[:3]])).logits[0, 22:]
    ours = torch.cat([c for c in captured if c.shape[0]])
    relative = (ours - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert relative.max() < 1e-4


def test_cpu_backend_equals_reference_on_mixed_steps(tiny):
    model, _ = tiny
    rng = random.Random(11)
    prompts = [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(5 + 9 * i)] for i in range(6)]
    outputs = {}
    for backend in ("reference", "cpu"):
        jobs = [
            Job(
                request_id=f"r{i}",
                prompt_ids=prompt_ids,
                sampling=SamplingParams(max_tokens=6, ignore_eos=True),
                join_step=i,
                chunk_size=5,
            )
            for i, prompt_ids in enumerate(prompts)
        ]
        run_jobs(Engine(model, KVCacheBudget(num_bytes=1 << 20, block_size=8), backend), jobs)
        outputs[backend] = [job.generated_ids for job in jobs]
    assert outputs["cpu"] == outputs["reference"]
