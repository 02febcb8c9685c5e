"""A fault of one request ends that request only: the engine drops it (its K/V
goes back), reports it in ``StepOutput.failed``, the step's other requests get
their tokens, and work planned for it afterwards is skipped."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.engine import STEP_FAILED_MESSAGE, Engine
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.llama import LlamaModel
from gpu_worker.local_blocks import step_alone
from gpu_worker.model_loading import load_model
from shared.messages import MAX_SEED, MAX_TOP_K, PrefillChunk, RequestSpec, SamplingParams, StepPlan
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(model_dir, device="cpu", dtype="float32")


def _engine(model: LlamaModel, num_blocks: int = 64) -> Engine:
    num_bytes = num_blocks * bytes_per_block(model.config, 4, model.dtype)
    return Engine(model, KVCacheBudget(num_bytes=num_bytes, block_size=4), "cpu")


def _plan(step_index: int, **fields: object) -> StepPlan:
    return StepPlan(worker_id="t", epoch=0, step_index=step_index, **fields)  # type: ignore[arg-type]


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(length)]


def _admit(step_index: int, prompts: dict[str, list[int]], sampling: dict[str, SamplingParams]):
    return _plan(
        step_index,
        new_requests=[
            RequestSpec(rid, len(ids), sampling.get(rid, GREEDY)) for rid, ids in prompts.items()
        ],
        prefill_chunks=[PrefillChunk(rid, ids, 0) for rid, ids in prompts.items()],
    )


def _alone(model: LlamaModel, prompt: list[int], sampling: SamplingParams = GREEDY) -> int:
    """The first token ``prompt`` gets on an engine of its own."""
    [token] = step_alone(_engine(model), _admit(0, {"x": prompt}, {"x": sampling})).tokens
    return token.token_id


@pytest.mark.parametrize("bad_id", [TINY_VOCAB_SIZE, 2**62, -1])
def test_a_prompt_token_outside_the_vocabulary_fails_only_its_request(model, bad_id):
    engine = _engine(model)
    good = _prompt(6)
    out = step_alone(engine, _admit(0, {"good": good, "bad": [5, bad_id, 7]}, {}))
    assert [f.request_id for f in out.failed] == ["bad"]
    assert "vocabulary" in out.failed[0].message and repr(bad_id) not in out.failed[0].message
    assert [(t.request_id, t.token_id) for t in out.tokens] == [("good", _alone(model, good))]
    assert engine.active_request_ids == ["good"]
    # A decode planned for it before the scheduler saw the failure is skipped.
    out = step_alone(engine, _plan(1, decode_request_ids=["good", "bad"]))
    assert [t.request_id for t in out.tokens] == ["good"] and out.failed == []


def test_a_failed_request_in_a_chunked_prefill_skips_its_next_chunk_and_frees_its_blocks(model):
    engine = _engine(model, num_blocks=16)
    bad = [*_prompt(8), TINY_VOCAB_SIZE + 3, *_prompt(7, 1)]
    out = step_alone(
        engine,
        _plan(
            0,
            new_requests=[RequestSpec("bad", len(bad), GREEDY)],
            prefill_chunks=[PrefillChunk("bad", bad[:8], 0)],
        ),
    )
    assert out.failed == [] and engine.num_free_blocks == 14
    out = step_alone(engine, _plan(1, prefill_chunks=[PrefillChunk("bad", bad[8:12], 8)]))
    assert [f.request_id for f in out.failed] == ["bad"]
    assert engine.num_free_blocks == 16 and engine.active_request_ids == []
    out = step_alone(engine, _plan(2, prefill_chunks=[PrefillChunk("bad", bad[12:], 12)]))
    assert (out.tokens, out.failed) == ([], [])


def test_a_request_past_the_context_fails_alone(model):
    engine = _engine(model, num_blocks=256)
    limit = model.config.max_position_embeddings
    good = _prompt(5)
    out = step_alone(engine, _admit(0, {"long": _prompt(limit + 1), "good": good}, {}))
    assert [f.request_id for f in out.failed] == ["long"]
    assert "context" in out.failed[0].message
    assert [(t.request_id, t.token_id) for t in out.tokens] == [("good", _alone(model, good))]


def test_logits_that_blew_up_fail_their_request_and_the_others_get_tokens(model, monkeypatch):
    engine = _engine(model)
    forward = model.forward

    def poisoned(**kwargs: object) -> torch.Tensor:
        logits = forward(**kwargs).clone()  # type: ignore[arg-type]
        logits[1] = float("nan")  # [rows that sample, vocab]: the second request's row
        return logits

    monkeypatch.setattr(model, "forward", poisoned)
    prompts = {"a": _prompt(5), "nan": _prompt(6, 1), "c": _prompt(7, 2)}
    hot = SamplingParams(temperature=0.7, seed=3, max_tokens=4, ignore_eos=True)
    out = step_alone(engine, _admit(0, prompts, {"c": hot}))
    monkeypatch.undo()
    assert [f.request_id for f in out.failed] == ["nan"]
    assert [t.request_id for t in out.tokens] == ["a", "c"]
    assert [t.token_id for t in out.tokens] == [
        _alone(model, prompts["a"]),
        _alone(model, prompts["c"], hot),
    ]
    assert sorted(engine.active_request_ids) == ["a", "c"]


def test_a_forward_that_raises_fails_its_step_and_the_engine_runs_the_next(model, monkeypatch):
    engine = _engine(model, num_blocks=16)

    def broken(**kwargs: object) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(model, "forward", broken)
    out = step_alone(engine, _admit(0, {"a": _prompt(5), "b": _prompt(6, 1)}, {}))
    monkeypatch.undo()
    assert [(f.request_id, f.message) for f in out.failed] == [
        ("a", STEP_FAILED_MESSAGE),
        ("b", STEP_FAILED_MESSAGE),
    ]
    assert engine.active_request_ids == [] and engine.num_free_blocks == 16
    prompt = _prompt(4, 9)
    out = step_alone(engine, _admit(1, {"next": prompt}, {}))
    assert [(t.request_id, t.token_id) for t in out.tokens] == [("next", _alone(model, prompt))]


def test_extreme_sampling_values_run_to_the_end_beside_ordinary_requests(model):
    engine = _engine(model)
    extreme = SamplingParams(
        temperature=5e-324,
        top_p=1e-50,
        top_k=MAX_TOP_K,
        seed=MAX_SEED,
        max_tokens=4,
        ignore_eos=True,
    )
    hottest = SamplingParams(temperature=100.0, top_p=5e-324, seed=0, max_tokens=4, ignore_eos=True)
    prompts = {"extreme": _prompt(5), "hottest": _prompt(6, 1), "plain": _prompt(7, 2)}
    outputs = [step_alone(engine, _admit(0, prompts, {"extreme": extreme, "hottest": hottest}))]
    for step_index in range(1, 4):
        outputs.append(step_alone(engine, _plan(step_index, decode_request_ids=list(prompts))))
    assert all(out.failed == [] for out in outputs)
    finished = [t.request_id for out in outputs for t in out.tokens if t.finish_reason == "length"]
    assert sorted(finished) == sorted(prompts)
    # A temperature below the epsilon is greedy: the same first token as temperature 0.
    assert outputs[0].tokens[0].token_id == _alone(model, prompts["extreme"])
