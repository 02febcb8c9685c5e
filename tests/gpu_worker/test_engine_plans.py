"""How the engine treats plans: joins, leaves, overlap, recompute and bad plans."""

from __future__ import annotations

import random

import pytest

from gpu_worker.engine import Engine, PlanError
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.local_blocks import step_alone
from gpu_worker.model_loading import load_model
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from tests.gpu_worker.plans import Job, run_jobs
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(model_dir, device="cpu", dtype="float32")


def _engine(model, num_blocks=64, block_size=4):
    num_bytes = num_blocks * bytes_per_block(model.config, block_size, model.dtype)
    return Engine(model, KVCacheBudget(num_bytes=num_bytes, block_size=block_size), "cpu")


def _plan(step_index, **fields):
    return StepPlan(worker_id="t", epoch=0, step_index=step_index, **fields)


def _prompt(length, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(length)]


def test_engine_reports_its_pool(model):
    engine = _engine(model, num_blocks=12, block_size=8)
    assert (engine.num_blocks, engine.block_size, engine.num_free_blocks) == (12, 8, 12)


def test_only_completed_prompts_and_decodes_sample(model):
    engine = _engine(model)
    prompt = _prompt(10)
    out = step_alone(
        engine,
        _plan(
            0,
            new_requests=[RequestSpec("a", 10, GREEDY)],
            prefill_chunks=[PrefillChunk("a", prompt[:6], 0)],
        ),
    )
    assert out.tokens == [] and out.num_new_tokens == 6
    out = step_alone(engine, _plan(1, prefill_chunks=[PrefillChunk("a", prompt[6:], 6)]))
    assert [(t.request_id, t.index) for t in out.tokens] == [("a", 0)]
    out = step_alone(engine, _plan(2, decode_request_ids=["a"]))
    assert [(t.request_id, t.index) for t in out.tokens] == [("a", 1)]


def test_stop_token_ends_with_stop_and_max_tokens_with_length(model):
    engine = _engine(model)
    prompt = _prompt(8, seed=1)
    probe = Job("probe", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    run_jobs(engine, [probe])
    assert probe.finish_reason == "length" and len(probe.generated_ids) == 3
    second_token = probe.generated_ids[1]
    stopper = Job("stopper", prompt, SamplingParams(max_tokens=3, stop_token_ids=(second_token,)))
    run_jobs(engine, [stopper])
    first_stop = probe.generated_ids.index(second_token)
    assert stopper.generated_ids == probe.generated_ids[: first_stop + 1]
    assert stopper.finish_reason == "stop"
    assert engine.num_free_blocks == engine.num_blocks


def test_a_finished_request_is_freed_and_a_late_decode_for_it_is_skipped(model):
    """Overlap: plan k+1 may still name a request that finished at step k."""
    engine = _engine(model)
    out = step_alone(
        engine,
        _plan(
            0,
            new_requests=[RequestSpec("a", 4, SamplingParams(max_tokens=1))],
            prefill_chunks=[PrefillChunk("a", _prompt(4), 0)],
        ),
    )
    assert out.tokens[0].finish_reason == "length"
    assert engine.num_free_blocks == engine.num_blocks
    out = step_alone(engine, _plan(1, decode_request_ids=["a"]))
    assert out.tokens == []


def test_release_frees_blocks_and_is_idempotent(model):
    engine = _engine(model)
    step_alone(
        engine,
        _plan(
            0,
            new_requests=[RequestSpec("a", 9, GREEDY)],
            prefill_chunks=[PrefillChunk("a", _prompt(9), 0)],
        ),
    )
    assert engine.num_free_blocks == engine.num_blocks - 3
    step_alone(engine, _plan(1, released_request_ids=["a", "never-seen"]))
    assert engine.num_free_blocks == engine.num_blocks
    assert engine.active_request_ids == []


def test_recompute_after_preemption_continues_with_the_same_tokens(model):
    """A request released mid-generation and readmitted with prompt + generated tokens
    goes on exactly as if it had never stopped (greedy and seeded sampling)."""
    prompt = _prompt(12, seed=5)
    for sampling in (
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=42),
    ):
        whole = Job("a", prompt, sampling)
        run_jobs(_engine(model), [whole])
        engine = _engine(model)
        step_alone(
            engine,
            _plan(
                0,
                new_requests=[RequestSpec("a", 12, sampling)],
                prefill_chunks=[PrefillChunk("a", prompt, 0)],
            ),
        )
        generated = [
            step_alone(engine, _plan(1 + i, decode_request_ids=["a"])).tokens[0].token_id
            for i in range(2)
        ]
        step_alone(engine, _plan(3, released_request_ids=["a"]))
        # The first token came from the prefill step; recover it from the uninterrupted run.
        so_far = whole.generated_ids[:3]
        assert generated == so_far[1:3]
        resumed = step_alone(
            engine,
            _plan(
                4,
                new_requests=[RequestSpec("a", 15, sampling, num_generated=3)],
                prefill_chunks=[PrefillChunk("a", prompt + so_far, 0)],
            ),
        ).tokens
        rest = [resumed[0].token_id]
        assert resumed[0].index == 3
        while True:
            out = step_alone(engine, _plan(5 + len(rest), decode_request_ids=["a"])).tokens[0]
            rest.append(out.token_id)
            if out.finish_reason:
                break
        assert so_far + rest == whole.generated_ids
        assert out.finish_reason == "length" and out.index == 7


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (_plan(1, decode_request_ids=["ghost"]), "not running here"),
        (_plan(1, prefill_chunks=[PrefillChunk("a", [5], 0)]), "chunk starts at 0 but 4"),
        (_plan(1, new_requests=[RequestSpec("a", 3, GREEDY)]), "already running"),
        (_plan(1, decode_request_ids=["a", "a"]), "appears twice"),
        (
            _plan(
                1,
                new_requests=[RequestSpec("b", 2, GREEDY)],
                prefill_chunks=[PrefillChunk("b", [5, 6, 7], 0)],
            ),
            "past its 2 prompt tokens",
        ),
        (
            _plan(
                1,
                new_requests=[RequestSpec("b", 8, GREEDY)],
                prefill_chunks=[PrefillChunk("b", [5] * 8, 0)],
                block_grants={"b": [5]},
            ),
            "needs 1 more K/V blocks than it was granted",
        ),
        (
            _plan(
                1,
                new_requests=[RequestSpec("b", 4, GREEDY)],
                prefill_chunks=[PrefillChunk("b", [5] * 4, 0)],
                block_grants={"b": [16]},
            ),
            "outside 0 to 15",
        ),
        (
            _plan(1, decode_request_ids=["a"], block_grants={"a": [-1]}),
            "outside 0 to 15",
        ),
        (
            _plan(1, decode_request_ids=["a"], block_grants={"a": [2**63 - 1]}),
            "outside 0 to 15",
        ),
        (
            _plan(
                1,
                new_requests=[RequestSpec("b", 9, GREEDY, num_cached_tokens=2**63 - 1)],
                block_grants={"b": [5, 6, 7]},
            ),
            "at least one must be computed",
        ),
        (
            _plan(
                1,
                new_requests=[RequestSpec("b", 8, GREEDY, num_cached_tokens=8)],
                block_grants={"b": [5, 6]},
            ),
            "at least one must be computed",
        ),
        (
            _plan(
                1,
                new_requests=[RequestSpec("b", 9, GREEDY, num_cached_tokens=8)],
                block_grants={"b": [5]},
            ),
            "8 cached tokens in 1 granted blocks",
        ),
        (
            _plan(
                1,
                new_requests=[RequestSpec("b", 9, GREEDY, num_cached_tokens=-4)],
                prefill_chunks=[PrefillChunk("b", [5], 0)],
            ),
            "at least one must be computed",
        ),
        (_plan(1, new_requests=[RequestSpec("b", 0, GREEDY)]), "needs a prompt"),
    ],
)
def test_a_bad_plan_is_refused_whole_and_changes_nothing(model, plan, message):
    engine = _engine(model, num_blocks=16)
    step_alone(
        engine,
        _plan(
            0,
            new_requests=[RequestSpec("a", 4, GREEDY)],
            prefill_chunks=[PrefillChunk("a", _prompt(4), 0)],
        ),
    )
    free_before = engine.num_free_blocks
    with pytest.raises(PlanError, match=message):
        engine.step(plan)  # as the scheduler sent it: no blocks granted here
    assert engine.num_free_blocks == free_before
    assert engine.active_request_ids == ["a"]
    # ...and the engine goes on as if the bad plan had never come.
    assert len(step_alone(engine, _plan(2, decode_request_ids=["a"])).tokens) == 1


def test_releasing_and_readmitting_in_one_plan_reuses_the_blocks(model):
    engine = _engine(model, num_blocks=3)
    step_alone(
        engine,
        _plan(
            0,
            new_requests=[RequestSpec("a", 12, GREEDY)],
            prefill_chunks=[PrefillChunk("a", _prompt(12), 0)],
        ),
    )
    assert engine.num_free_blocks == 0
    out = step_alone(
        engine,
        _plan(
            1,
            released_request_ids=["a"],
            new_requests=[RequestSpec("b", 12, GREEDY)],
            prefill_chunks=[PrefillChunk("b", _prompt(12, 2), 0)],
        ),
    )
    assert [t.request_id for t in out.tokens] == ["b"]
