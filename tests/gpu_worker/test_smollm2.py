"""The engine on the real SmolLM2-135M-Instruct weights, against Hugging Face transformers.

Eight chat prompts of different lengths join at different steps, are
prefilled in chunks, decode side by side and leave as they finish; each must
produce exactly the tokens transformers' greedy generation gives it alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from gateway.tokenizer import ChatTokenizer
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.local_blocks import step_alone
from gpu_worker.model_loading import load_model
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from tests.gpu_worker.plans import Job, run_jobs

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than one hundred, please.",
    "Translate 'good morning' into Spanish and German.",
    "You are a pirate. Describe your ship, your crew and the treasure you are looking for, "
    "in the voice of an old sailor telling the story to children in a harbour tavern at night.",
    "Summarise the plot of Romeo and Juliet for someone who has never heard of it. "
    "Mention the families, the balcony, the secret marriage, the duel, the exile, the potion "
    "and how the story ends, and say in one sentence what the play is about.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2(prepared_model_dir):
    tokenizer = ChatTokenizer.from_model_dir(prepared_model_dir)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": question}]),
            add_special_tokens=False,
        )
        for question in QUESTIONS
    ]
    model = load_model(prepared_model_dir, device="cpu", dtype="float32")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        prepared_model_dir, dtype=torch.float32
    ).eval()
    return model, reference, prompts


def _hf_greedy(reference, prompt_ids: list[int], stop_ids: set[int]) -> list[int]:
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=sorted(stop_ids),
            pad_token_id=2,
        )[0, len(prompt_ids) :].tolist()
    return generated


def test_prompts_have_different_lengths(smollm2):
    _, _, prompts = smollm2
    lengths = sorted(len(p) for p in prompts)
    assert lengths[-1] > 2.5 * lengths[0] and len(set(lengths)) >= 6


def test_staggered_chunked_batch_equals_transformers_greedy(smollm2):
    model, reference, prompts = smollm2
    jobs = [
        Job(
            request_id=f"chat{i}",
            prompt_ids=prompt_ids,
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
            join_step=[0, 0, 1, 3, 4, 6, 9, 12][i],
            chunk_size=[1000, 16, 7, 1000, 32, 13, 40, 64][i],
        )
        for i, prompt_ids in enumerate(prompts)
    ]
    engine = Engine(model, KVCacheBudget(num_bytes=256 << 20), "cpu")
    outputs = run_jobs(engine, jobs)
    # Requests really did run side by side with prompt chunks and decodes in one step.
    assert max(len(output.tokens) for output in outputs) >= 6
    stop_ids = set(model.config.eos_token_ids)
    for job in jobs:
        expected = _hf_greedy(reference, job.prompt_ids, stop_ids)
        assert job.generated_ids == expected, job.request_id
        assert job.finish_reason == ("stop" if expected[-1] in stop_ids else "length")
    assert any(job.finish_reason == "stop" for job in jobs)
    assert engine.num_free_blocks == engine.num_blocks


def test_step_logits_within_1e4_of_transformers(smollm2):
    model, reference, prompts = smollm2
    prompt_ids = prompts[3]
    engine = Engine(model, KVCacheBudget(num_bytes=64 << 20), "cpu")
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    split = len(prompt_ids) // 2
    captured = []
    original_forward = model.forward

    def capture(**kwargs):
        captured.append(original_forward(**kwargs))
        return captured[-1]

    model.forward = capture  # type: ignore[method-assign]
    try:
        step_alone(
            engine,
            StepPlan(
                "t",
                0,
                0,
                new_requests=[RequestSpec("a", len(prompt_ids), sampling)],
                prefill_chunks=[PrefillChunk("a", prompt_ids[:split], 0)],
            ),
        )
        tokens = [
            t.token_id
            for t in step_alone(
                engine,
                StepPlan("t", 0, 1, prefill_chunks=[PrefillChunk("a", prompt_ids[split:], split)]),
            ).tokens
        ]
        for step_index in range(2, 5):
            tokens += [
                t.token_id
                for t in step_alone(
                    engine, StepPlan("t", 0, step_index, decode_request_ids=["a"])
                ).tokens
            ]
    finally:
        del model.forward
    with torch.no_grad():
        expected = reference(torch.tensor([prompt_ids + tokens[:3]])).logits[
            0, len(prompt_ids) - 1 :
        ]
    ours = torch.cat([logits for logits in captured if logits.shape[0]])
    relative_error = (ours - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert relative_error.max() < 1e-4


def test_cpu_backend_equals_reference_backend(smollm2):
    model, _, prompts = smollm2
    results = {}
    for backend in ("reference", "cpu"):
        jobs = [
            Job(f"r{i}", prompt_ids, SamplingParams(max_tokens=8), join_step=i, chunk_size=24)
            for i, prompt_ids in enumerate(prompts[4:])
        ]
        run_jobs(Engine(model, KVCacheBudget(num_bytes=64 << 20), backend), jobs)
        results[backend] = [job.generated_ids for job in jobs]
    assert results["cpu"] == results["reference"]
