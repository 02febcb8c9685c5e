"""The Triton paged-attention and K/V-write kernels against the reference, on the CPU.

These machines have no GPU: Triton's interpreter (``TRITON_INTERPRET=1``)
runs the same kernels on CPU tensors, program by program. It must be set
before the kernels are decorated, so before gpu_worker.attention_triton is
imported. Shapes stay small because the interpreter is slow.
"""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import random
import sys

import pytest
import torch
import triton  # noqa: F401  (a test dependency: the kernels need it)

from gpu_worker.attention import (
    BackendUnavailableError,
    SequenceLayout,
    default_backend_name,
    make_backend,
)
from gpu_worker.attention_reference import ReferenceAttention
from gpu_worker.attention_triton import (
    TritonAttention,
    kernels_are_interpreted,
    query_tiles,
    request_table,
)
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.kv_write_triton import PADDING_SLOT, write_kv
from gpu_worker.model_loading import load_model
from tests.gpu_worker.plans import Job, random_jobs, run_jobs
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def test_the_kernels_run_in_the_interpreter():
    # Guards every other test here: compiled kernels cannot run on CPU tensors.
    assert kernels_are_interpreted()


def _layout(
    shapes: list[tuple[int, int]], block_size: int, num_blocks: int, rng: random.Random
) -> list[SequenceLayout]:
    """(num_query_tokens, num_cached_tokens) per request, each on shuffled, scattered blocks."""
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    layout, query_start = [], 0
    for num_query, num_cached in shapes:
        num_needed = -(-(num_query + num_cached) // block_size)
        table = [free_blocks.pop() for _ in range(num_needed)]
        layout.append(SequenceLayout(query_start, num_query, num_cached, table))
        query_start += num_query
    return layout


def _random_shapes(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    """Mixed step: prompt chunks (with and without cache) and decodes, odd lengths and
    lengths that end one short of, on, and one past a block boundary."""
    edges = [block_size - 1, block_size, block_size + 1, 2 * block_size + 1]
    return [
        (rng.choice([3, 7, 9]), 0),  # first chunk of a prompt
        (rng.choice([2, 5]), rng.choice(edges)),  # later chunk, starting mid-block
        (1, rng.choice(edges)),  # decodes
        (1, rng.randrange(0, 3 * block_size)),
        (1, 0),  # a one-token prompt
        (rng.choice([1, 4]), rng.randrange(17, 40)),
    ]


def _compare(
    layout: list[SequenceLayout],
    block_size: int,
    num_blocks: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    block_n: int = 16,
    reverse_tiles: bool = False,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_tokens = sum(sequence.num_query_tokens for sequence in layout)
    num_slots = num_blocks * block_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    queries = normal(num_tokens, num_heads, head_dim)
    keys, values = (
        normal(num_slots, num_kv_heads, head_dim),
        normal(num_slots, num_kv_heads, head_dim),
    )
    reference = ReferenceAttention()
    # The truth: the same (possibly bf16-rounded) inputs attended in fp32.
    expected = reference.attend(
        queries.float(), keys.float(), values.float(), reference.prepare(layout, block_size, CPU)
    )
    backend = TritonAttention(dtype, prefill_tile_tokens=4, block_n=block_n)
    output = torch.full_like(queries, float("nan"))  # poison: every element must be written
    plan = backend.prepare(layout, block_size, CPU)
    if reverse_tiles:
        # Tiles may run in any order on a GPU; the interpreter runs them in
        # order, so reversing catches a tile writing rows that belong to another.
        plan = dataclasses.replace(plan, tiles=plan.tiles.flip(0))
    backend.attend_into(output, queries, keys, values, plan)
    assert not output.isnan().any(), "some output elements were never written"
    relative_error = (output.float() - expected).abs().max() / expected.abs().max()
    assert relative_error < TOLERANCE[dtype], f"relative error {relative_error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 4), (4, 2), (6, 2), (8, 1)],
    ids=["mha", "gqa2", "gqa3", "mqa"],
)
@pytest.mark.parametrize("head_dim", [16, 32])
def test_mixed_step_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    seed = hash((num_heads, num_kv_heads, head_dim)) % 1000
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    layout = _layout(_random_shapes(rng, block_size), block_size, 64, rng)
    _compare(layout, block_size, 64, num_heads, num_kv_heads, head_dim, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_only_step_matches_reference(dtype):
    # Decode-only steps use one-token tiles (the CUDA-graph path): a separate kernel variant.
    rng = random.Random(3)
    shapes = [(1, n) for n in (0, 3, 4, 5, 15, 16, 17, 33, 47)]
    layout = _layout(shapes, 4, 64, rng)
    assert TritonAttention(dtype).prepare(layout, 4, CPU).tile_tokens == 1
    _compare(layout, 4, 64, num_heads=6, num_kv_heads=2, head_dim=32, dtype=dtype, seed=3)


def test_odd_block_size_head_dim_and_key_tile():
    # Nothing in the kernel needs a power-of-two block size or head_dim; a key
    # tile (32) larger than a block (5) walks several blocks per iteration.
    rng = random.Random(5)
    layout = _layout([(6, 0), (1, 21), (3, 9), (1, 4)], 5, 32, rng)
    _compare(layout, 5, 32, 4, 2, 24, torch.float32, seed=5, block_n=32)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_prompt_longer_than_several_query_tiles(num_kv_heads):
    rng = random.Random(11)
    layout = _layout([(19, 0), (13, 6)], 8, 16, rng)
    _compare(layout, 8, 16, 4, num_kv_heads, 16, torch.float32, seed=11, reverse_tiles=True)


def test_request_table_and_tiles():
    layout = [
        SequenceLayout(query_start=0, num_query_tokens=5, num_cached_tokens=2, block_table=[7, 3]),
        SequenceLayout(
            query_start=5, num_query_tokens=1, num_cached_tokens=9, block_table=[1, 4, 0]
        ),
    ]
    assert request_table(layout).tolist() == [[0, 5, 2, 7, 3, 0], [5, 1, 9, 1, 4, 0]]
    assert query_tiles(layout, 2).tolist() == [[0, 0], [0, 2], [0, 4], [1, 0]]
    assert query_tiles(layout, 16).tolist() == [[0, 0], [1, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_matches_index_copy_and_skips_padding_slots(dtype):
    generator = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, num_slots = 7, 3, 16, 40
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    # As in the model: value is a strided view into the fused QKV projection.
    key = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].reshape(-1, num_kv_heads, head_dim)
    value = qkv[:, (4 + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    assert not value.is_contiguous()
    slots = torch.tensor([12, 3, PADDING_SLOT, 39, 0, PADDING_SLOT, 21])
    pool_keys = torch.randn(num_slots, num_kv_heads, head_dim, generator=generator).to(dtype)
    pool_values = torch.randn(num_slots, num_kv_heads, head_dim, generator=generator).to(dtype)
    expected_keys, expected_values = pool_keys.clone(), pool_values.clone()
    stored = slots >= 0
    expected_keys.index_copy_(0, slots[stored], key[stored])
    expected_values.index_copy_(0, slots[stored], value[stored])
    write_kv(pool_keys, pool_values, slots, key, value)
    assert torch.equal(pool_keys, expected_keys)
    assert torch.equal(pool_values, expected_values)


def test_backend_selection():
    assert isinstance(make_backend("triton", torch.bfloat16), TritonAttention)
    assert default_backend_name(torch.device("cuda")) == "triton"
    assert default_backend_name(CPU) == "cpu"


def test_a_missing_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(BackendUnavailableError, match="needs the triton package"):
        make_backend("triton", torch.float32)
    assert default_backend_name(torch.device("cuda")) == "cpu"


def test_bad_tile_sizes_are_rejected():
    with pytest.raises(ValueError, match="power of two"):
        TritonAttention(block_n=24)
    with pytest.raises(ValueError, match="prefill_tile_tokens"):
        TritonAttention(prefill_tile_tokens=0)


def test_engine_with_triton_gives_the_reference_greedy_tokens(tmp_path):
    """Staggered joins, chunked prompts and decodes in the same steps, both K/V writers."""
    model = load_model(write_tiny_model(tmp_path / "tiny", "llama"), device="cpu", dtype="float32")

    def jobs() -> list[Job]:
        return random_jobs(2, 4, TINY_VOCAB_SIZE, 14, (2, 5), 3, (3, 5, 100))

    generated = {}
    for backend in ("reference", "triton"):
        engine = Engine(model, KVCacheBudget(num_bytes=1 << 20, block_size=4), backend)
        backend_jobs = jobs()
        run_jobs(engine, backend_jobs)
        generated[backend] = [job.generated_ids for job in backend_jobs]
        assert engine.num_free_blocks == engine.num_blocks
    assert generated["triton"] == generated["reference"]
