"""The Triton pointwise kernels (norm, RoPE + K/V store, SwiGLU) against the torch ops.

Run on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``, set before the
kernels are imported; see test_attention_triton.py). Sizes are odd on purpose:
head counts and head dims that are not powers of two, so every mask is used.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"


import pytest
import torch

from gpu_worker.attention import kv_writer, make_backend
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.kv_write_triton import PADDING_SLOT
from gpu_worker.llama import LlamaModel
from gpu_worker.model_config import ModelConfig, RopeScaling
from gpu_worker.model_loading import load_model
from gpu_worker.pointwise import TorchPointwise, default_pointwise_name, make_pointwise
from gpu_worker.pointwise_triton import TritonPointwise
from gpu_worker.rotary import RotaryEmbedding
from tests.gpu_worker.plans import Job, random_jobs, run_jobs
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
# The kernels round to bf16 where torch does, but Triton's interpreter truncates where a
# GPU rounds to nearest: on the CPU each bf16 rounding may be a step (2**-8) off, and
# the norm rounds three times.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2**-5}
TORCH, TRITON = TorchPointwise(), TritonPointwise()


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert not got.isnan().any()
    scale = expected.float().abs().max().clamp_min(1e-6)
    error = float((got.float() - expected.float()).abs().max() / scale)
    assert error <= TOLERANCE[dtype], f"max relative error {error:.2e}"


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(dtype, with_delta):
    size = 72  # not a power of two: the block is masked
    hidden, weight = randn(7, size, dtype=dtype, seed=0), randn(size, dtype=dtype, seed=1)
    delta = randn(7, size, dtype=dtype, seed=2) if with_delta else None
    expected_hidden, expected_normed = TORCH.add_rms_norm(hidden.clone(), delta, weight, 1e-5)
    got_hidden, got_normed = TRITON.add_rms_norm(hidden.clone(), delta, weight, 1e-5)
    assert_close(got_hidden, expected_hidden, dtype)
    assert_close(got_normed, expected_normed, dtype)


def test_add_rms_norm_of_no_rows():
    hidden, normed = TRITON.add_rms_norm(torch.empty(0, 8), None, torch.ones(8), 1e-5)
    assert hidden.shape == normed.shape == (0, 8)


def _config(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=32, hidden_size=num_heads * head_dim, intermediate_size=8,
        num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rope_theta=10000.0, rms_norm_eps=1e-5, rope_scaling=RopeScaling(),
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
        eos_token_ids=(2,),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 48), (9, 3, 16)])
def test_rope_and_store_kv_matches_torch(dtype, num_heads, num_kv_heads, head_dim):
    config = _config(num_heads, num_kv_heads, head_dim)
    rotary = RotaryEmbedding(config, CPU, dtype)
    num_tokens, num_slots = 5, 20
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=3)
    positions = torch.tensor([0, 7, 63, 1, 30])
    slots = torch.tensor([4, 19, PADDING_SLOT, 0, 11])  # the padding row stores nothing
    results = {}
    for ops in (TORCH, TRITON):
        # Poisoned pools: a slot not written keeps its NaN.
        keys = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        values = keys.clone()
        writer = kv_writer(make_backend("triton", dtype))  # skips padding slots too
        query = ops.rope_and_store_kv(
            qkv, num_heads, num_kv_heads, ops.rotary_inputs(rotary, positions),
            slots, keys, values, writer,
        )  # fmt: skip
        results[ops.name] = query, keys, values
    expected_query, expected_keys, expected_values = results["torch"]
    got_query, got_keys, got_values = results["triton"]
    assert_close(got_query, expected_query, dtype)
    assert torch.equal(got_keys.isnan(), expected_keys.isnan())
    assert_close(got_keys.nan_to_num(), expected_keys.nan_to_num(), dtype)
    assert torch.equal(got_values.nan_to_num(), expected_values.nan_to_num())  # a plain copy
    written = slots[slots >= 0]
    assert not got_keys[written].isnan().any()
    assert got_keys.isnan().flatten(1).all(1).sum() == num_slots - len(written)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    size = 1500  # two column blocks, the second partly masked
    gate_up = randn(3, 2 * size, dtype=dtype, seed=4) * 4
    assert_close(TRITON.silu_mul(gate_up), TORCH.silu_mul(gate_up), dtype)


def test_pointwise_selection():
    assert default_pointwise_name(torch.device("cuda")) == "triton"
    assert default_pointwise_name(CPU) == "torch"
    assert isinstance(make_pointwise("triton"), TritonPointwise)
    with pytest.raises(ValueError, match="not one of torch, triton"):
        make_pointwise("fused")


def test_forward_and_engine_with_triton_pointwise_match_torch(tmp_path):
    """The whole model: logits of a mixed step, then greedy tokens of staggered, chunked
    requests (both attention backends' K/V writers are bypassed by the fused store)."""
    torch_model = load_model(write_tiny_model(tmp_path / "tiny", "llama"), "cpu", "float32")
    assert torch_model.pointwise.name == "torch"
    triton_model = LlamaModel(
        torch_model.config, torch_model.weights, CPU, torch.float32, make_pointwise("triton")
    )

    def jobs() -> list[Job]:
        return random_jobs(5, 4, TINY_VOCAB_SIZE, 14, (2, 6), 3, (3, 5, 100))

    generated = {}
    for name, model, backend in (
        ("torch", torch_model, "reference"),
        ("triton", triton_model, "triton"),
        ("triton ops, cpu attention", triton_model, "cpu"),
    ):
        engine = Engine(model, KVCacheBudget(num_bytes=1 << 20, block_size=4), backend)
        model_jobs = jobs()
        run_jobs(engine, model_jobs)
        generated[name] = [job.generated_ids for job in model_jobs]
        assert engine.num_free_blocks == engine.num_blocks
    assert generated["triton"] == generated["torch"]
    assert generated["triton ops, cpu attention"] == generated["torch"]
