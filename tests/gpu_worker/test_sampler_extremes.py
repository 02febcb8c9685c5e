"""``sample()`` on every extreme value the protocol admits: always a token id in
[0, vocab) for finite logits, the same one for the same (seed, index), and a
SamplingError only for rows with nothing to sample from."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.sampler import SamplingError, filtered_probabilities, sample
from shared.messages import (
    GREEDY_TEMPERATURE_EPSILON,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    SamplingParams,
)

VOCAB = 7
FP32_MAX = float(torch.finfo(torch.float32).max)

TEMPERATURES = [
    0.0,
    5e-324,  # the smallest float64 subnormal
    sys.float_info.min,  # the smallest normal float64
    float(torch.finfo(torch.float32).tiny),  # the smallest normal float32
    1.4e-45,  # about the smallest float32 subnormal
    GREEDY_TEMPERATURE_EPSILON / 2,
    GREEDY_TEMPERATURE_EPSILON,
    GREEDY_TEMPERATURE_EPSILON * 1.0000001,
    1e-3,
    1.0,
    MAX_TEMPERATURE,
]
TOP_PS = [5e-324, 1e-300, 1e-50, 1.4e-45, 1e-5, 0.5, 0.999999, 1.0]
TOP_KS = [0, 1, VOCAB - 1, VOCAB, VOCAB + 1, MAX_TOP_K]
SEEDS = [0, 1, MAX_SEED]
INDICES = [0, 1, 4095, 2**31]


def _logit_rows() -> st.SearchStrategy[list[float]]:
    finite = st.floats(min_value=-FP32_MAX, max_value=FP32_MAX, width=32)
    extremes = st.sampled_from([FP32_MAX, -FP32_MAX, 3e38, -3e38, 0.0, -0.0, 1e-45])
    mixed = st.lists(st.one_of(finite, extremes), min_size=VOCAB, max_size=VOCAB)
    all_equal = st.builds(lambda value: [value] * VOCAB, st.one_of(finite, extremes))
    one_finite = st.builds(
        lambda position, value: [value if i == position else float("-inf") for i in range(VOCAB)],
        st.integers(0, VOCAB - 1),
        st.one_of(finite, extremes),
    )
    some_masked = st.builds(
        lambda row, masked: (
            [float("-inf") if m else v for v, m in zip(row, masked, strict=True)]
            if not all(masked)
            else row
        ),
        mixed,
        st.lists(st.booleans(), min_size=VOCAB, max_size=VOCAB),
    )
    return st.one_of(mixed, all_equal, one_finite, some_masked)


def _params() -> st.SearchStrategy[SamplingParams]:
    return st.builds(
        SamplingParams,
        temperature=st.one_of(
            st.sampled_from(TEMPERATURES), st.floats(min_value=0.0, max_value=MAX_TEMPERATURE)
        ),
        top_p=st.one_of(
            st.sampled_from(TOP_PS),
            st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
        ),
        top_k=st.one_of(st.sampled_from(TOP_KS), st.integers(0, MAX_TOP_K)),
        max_tokens=st.just(2**63 - 1),  # never read by the sampler; any min_tokens fits below
        # Around the sampled indices, so that a row is held back or not.
        min_tokens=st.one_of(
            st.sampled_from([0, 1, 2, 4096, 2**31 + 1]), st.integers(0, 2**63 - 1)
        ),
    )


def _stop_ids() -> st.SearchStrategy[frozenset[int]]:
    # Ids outside the vocabulary too (a stop id the model has no row for).
    return st.frozensets(st.integers(-2, VOCAB + 1), max_size=VOCAB + 2)


@settings(max_examples=250, deadline=None)
@given(
    rows=st.lists(_logit_rows(), min_size=1, max_size=4),
    data=st.data(),
)
def test_every_admitted_value_samples_a_valid_token_deterministically(rows, data):
    logits = torch.tensor(rows, dtype=torch.float32)
    params = [data.draw(_params()) for _ in rows]
    seeds = [data.draw(st.one_of(st.sampled_from(SEEDS), st.integers(0, MAX_SEED))) for _ in rows]
    indices = [data.draw(st.sampled_from(INDICES)) for _ in rows]
    stop_ids = [data.draw(_stop_ids()) for _ in rows]
    first = sample(logits, params, seeds, indices, stop_ids)
    again = sample(logits.clone(), params, seeds, indices, stop_ids)
    assert len(first) == len(rows)
    for row, token_id in enumerate(first):
        held_back = stop_ids[row] if indices[row] < params[row].min_tokens else frozenset()
        if all(logits[row, i] == float("-inf") for i in range(VOCAB) if i not in held_back):
            # min_tokens held back every token the row could draw.
            assert isinstance(token_id, SamplingError)
            assert isinstance(again[row], SamplingError)
            continue
        assert isinstance(token_id, int), (rows[row], params[row])
        assert 0 <= token_id < VOCAB
        # A token the filters or the -inf mask removed is never drawn.
        assert logits[row, token_id] > float("-inf")
        assert token_id not in held_back
        assert again[row] == token_id


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("top_p", TOP_PS)
@pytest.mark.parametrize("top_k", TOP_KS)
def test_the_filters_always_keep_the_top_token(temperature, top_p, top_k):
    logits = torch.tensor([3e38, -3e38, 1.0, 2.0, 2.0, float("-inf"), 0.0])
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    probabilities = filtered_probabilities(logits, params)
    assert torch.isfinite(probabilities).all()
    assert probabilities[0] > 0 and probabilities.sum().item() == pytest.approx(1.0)
    [token_id] = sample(logits.unsqueeze(0), [params], [MAX_SEED], [0])
    assert token_id == 0  # 3e38 dominates everything at every temperature up to 100


def test_a_temperature_below_the_epsilon_is_greedy():
    logits = torch.tensor([[0.0, 1.0, 0.999999, 0.5, 0.0, 0.0, 0.0]])
    for temperature in (5e-324, 1e-300, GREEDY_TEMPERATURE_EPSILON / 2):
        params = SamplingParams(temperature=temperature)
        assert [sample(logits, [params], [seed], [0])[0] for seed in range(50)] == [1] * 50


def test_a_top_p_far_below_float32_keeps_only_the_top_token():
    logits = torch.tensor([1.0, 1.0 - 1e-6, 0.0, 0.0, 0.0, 0.0, 0.0])
    probabilities = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=1e-50))
    assert probabilities.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "bad_row",
    [
        [float("nan")] + [0.0] * (VOCAB - 1),
        [5.0] * (VOCAB - 1) + [float("nan")],  # after the largest: the max still sees it
        [float("inf")] + [0.0] * (VOCAB - 1),
        [float("-inf")] * (VOCAB - 1) + [float("nan")],
        [float("-inf")] * VOCAB,
    ],
    ids=["nan", "nan_last", "plus_inf", "nan_among_minus_inf", "all_minus_inf"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_that_blew_up_is_its_own_error_and_the_others_still_sample(bad_row, temperature):
    good_row = [0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    logits = torch.tensor([good_row, bad_row, good_row])
    params = [SamplingParams(temperature=temperature)] * 3
    first, error, last = sample(logits, params, [1, 2, 3], [0, 0, 0])
    assert isinstance(error, SamplingError)
    assert isinstance(first, int) and isinstance(last, int)
    assert 0 <= first < VOCAB and 0 <= last < VOCAB
