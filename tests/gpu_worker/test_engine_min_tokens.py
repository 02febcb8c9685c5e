"""``min_tokens`` on a real (tiny) model: no stop token id, EOS included, is
sampled before a request has generated that many tokens; after, it ends the
request as usual; with ``ignore_eos`` EOS stays an ordinary token."""

from __future__ import annotations

import random

import msgspec
import pytest

from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.llama import LlamaModel
from gpu_worker.model_loading import load_model
from shared.messages import SamplingParams
from tests.gpu_worker.plans import Job, run_jobs
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

PROMPT = [random.Random(0).randrange(3, TINY_VOCAB_SIZE) for _ in range(8)]
MAX_TOKENS = 12


def _run(model: LlamaModel, sampling: SamplingParams) -> Job:
    engine = Engine(model, KVCacheBudget(num_bytes=2 << 20, block_size=4), "cpu")
    job = Job("r", PROMPT, sampling)
    run_jobs(engine, [job])
    assert engine.num_free_blocks == engine.num_blocks
    return job


@pytest.fixture(scope="module")
def first_greedy_token(tmp_path_factory) -> int:
    """The token greedy decoding of PROMPT starts with on the tiny model."""
    model_dir = write_tiny_model(tmp_path_factory.mktemp("probe"), "llama")
    model = load_model(model_dir, device="cpu", dtype="float32")
    return _run(model, SamplingParams(max_tokens=1, ignore_eos=True)).generated_ids[0]


@pytest.fixture(scope="module")
def eos_first_model(tmp_path_factory, first_greedy_token) -> LlamaModel:
    """The same weights (the writer seeds them), with that first token as EOS:
    greedy decoding of PROMPT then ends at once."""
    model_dir = write_tiny_model(
        tmp_path_factory.mktemp("eos_first"), "llama", eos_token_id=first_greedy_token
    )
    model = load_model(model_dir, device="cpu", dtype="float32")
    assert model.config.eos_token_ids == (first_greedy_token,)
    return model


def test_without_min_tokens_greedy_ends_on_eos_at_once(eos_first_model, first_greedy_token):
    job = _run(eos_first_model, SamplingParams(max_tokens=MAX_TOKENS))
    assert (job.generated_ids, job.finish_reason) == ([first_greedy_token], "stop")


@pytest.mark.parametrize("min_tokens", [1, 4, MAX_TOKENS])
def test_min_tokens_holds_eos_back(eos_first_model, first_greedy_token, min_tokens):
    job = _run(eos_first_model, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=min_tokens))
    assert len(job.generated_ids) >= min_tokens
    assert first_greedy_token not in job.generated_ids[:min_tokens]
    if job.finish_reason == "stop":
        assert job.generated_ids[-1] == first_greedy_token
    else:
        assert (job.finish_reason, len(job.generated_ids)) == ("length", MAX_TOKENS)


def test_with_ignore_eos_min_tokens_changes_nothing(eos_first_model, first_greedy_token):
    plain = _run(eos_first_model, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    held = _run(
        eos_first_model, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=5)
    )
    assert held.generated_ids == plain.generated_ids == [first_greedy_token] * MAX_TOKENS
    assert held.finish_reason == "length"


def test_a_stop_token_id_is_not_sampled_before_min_tokens(eos_first_model, first_greedy_token):
    # ignore_eos: the request's own stop id is held back all the same.
    sampling = SamplingParams(
        max_tokens=MAX_TOKENS, stop_token_ids=(first_greedy_token,), ignore_eos=True
    )
    assert _run(eos_first_model, sampling).generated_ids == [first_greedy_token]
    held = _run(eos_first_model, msgspec.structs.replace(sampling, min_tokens=3))
    assert first_greedy_token not in held.generated_ids[:3]
    assert len(held.generated_ids) >= 3


def test_a_stop_token_id_ends_the_request_once_min_tokens_are_out(eos_first_model):
    """Every id but one is a stop id: before min_tokens only that one can be drawn;
    from min_tokens on, the seeded draw soon lands on a stop id and ends the request."""
    kept = 5
    sampling = SamplingParams(
        temperature=2.0,
        seed=7,
        max_tokens=MAX_TOKENS,
        min_tokens=3,
        stop_token_ids=tuple(i for i in range(TINY_VOCAB_SIZE) if i != kept),
    )
    job = _run(eos_first_model, sampling)
    assert job.generated_ids[:3] == [kept] * 3
    assert job.finish_reason == "stop"
    assert len(job.generated_ids) > 3 and job.generated_ids[-1] != kept
