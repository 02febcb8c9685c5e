"""Sampling: filters do what they say; a seeded request draws the same alone or batched."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.model_loading import load_model
from gpu_worker.sampler import SamplingError, filtered_probabilities, mix_seed, sample
from shared.messages import SamplingParams
from tests.gpu_worker.plans import Job, run_jobs
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

LOGITS = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])


def test_greedy_takes_the_argmax():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    assert sample(logits, [SamplingParams()] * 2, [1, 2], [0, 0]) == [0, 4]


def test_top_k_keeps_the_k_most_likely():
    probabilities = filtered_probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (probabilities[2:] == 0).all()
    assert torch.allclose(probabilities[:2], LOGITS[:2].double().softmax(-1))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    full = LOGITS.double().softmax(-1)  # about 0.64, 0.24, 0.09, 0.03, 0.01
    probabilities = filtered_probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))
    assert (probabilities[:2] > 0).all() and (probabilities[2:] == 0).all()
    assert torch.allclose(probabilities[:2], full[:2] / full[:2].sum())
    only_top = filtered_probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert only_top.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_temperature_sharpens_and_flattens():
    cold = filtered_probabilities(LOGITS, SamplingParams(temperature=0.1))
    hot = filtered_probabilities(LOGITS, SamplingParams(temperature=10.0))
    assert cold[0] > 0.99 and hot.max() < 0.3


def test_sampling_follows_the_distribution():
    params = SamplingParams(temperature=1.0)
    draws = [sample(LOGITS.unsqueeze(0), [params], [seed], [0])[0] for seed in range(3000)]
    frequency = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    assert torch.allclose(frequency, LOGITS.softmax(-1), atol=0.03)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_ids_are_held_back_below_min_tokens_only(temperature):
    """Row 0's stop ids 0 and 1 (the two likeliest) cannot be drawn at indices 0..2
    (min_tokens 3), and are again from index 3; row 1, without stop ids, is untouched."""
    logits = torch.stack([LOGITS * 10, LOGITS * 10])
    params = [SamplingParams(temperature=temperature, min_tokens=3)] * 2
    stop_ids = [frozenset({0, 1, 99, -1}), frozenset()]  # ids outside the vocabulary are skipped
    for index in range(3):
        held, free = sample(logits, params, [index, index], [index, index], stop_ids)
        assert held == 2 and free == 0
    assert sample(logits, params, [3, 3], [3, 3], stop_ids) == [0, 0]
    assert torch.equal(logits, torch.stack([LOGITS * 10, LOGITS * 10]))  # not written to


def test_a_row_whose_every_token_is_held_back_is_its_own_error():
    logits = torch.stack([LOGITS, LOGITS])
    params = [SamplingParams(min_tokens=1)] * 2
    error, token_id = sample(logits, params, [0, 0], [0, 0], [frozenset(range(5)), {0}])
    assert isinstance(error, SamplingError) and token_id == 1


def test_mixed_seeds_spread():
    assert len({mix_seed(7, index) for index in range(1000)}) == 1000
    assert mix_seed(1, 0) != mix_seed(0, 1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(model_dir, device="cpu", dtype="float32")


def test_seeded_request_draws_the_same_tokens_alone_and_batched(model):
    rng = random.Random(1)
    prompt = [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(17)]
    sampling = SamplingParams(
        temperature=1.3, top_p=0.95, top_k=40, seed=1234, max_tokens=16, ignore_eos=True
    )

    def run(with_neighbours: bool) -> list[int]:
        engine = Engine(model, KVCacheBudget(num_bytes=2 << 20, block_size=4), "cpu")
        jobs = [Job("seeded", prompt, sampling, join_step=2, chunk_size=5)]
        if with_neighbours:
            jobs += [
                Job(
                    f"n{i}",
                    [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(9 + i)],
                    SamplingParams(temperature=0.8, max_tokens=10 + i, ignore_eos=True),
                    join_step=i,
                )
                for i in range(5)
            ]
        run_jobs(engine, jobs)
        return jobs[0].generated_ids

    alone = run(with_neighbours=False)
    assert alone == run(with_neighbours=True)
    assert len(set(alone)) > 3  # it really sampled
