"""The paged decode attention (gpu_worker/decode_attention.py) against the literal
split/merge reference: uncompiled for every shape, compiled once (a few seconds)
for batches of decodes in shuffled blocks, alone and beside prompt chunks; the
CPU backend's choice between it and SDPA; and the ways a compile is refused.
An engine's mixed steps through it: test_compiled_decode.py, on its compiled engine."""

from __future__ import annotations

import random

import pytest
import torch
from structlog.testing import capture_logs

from gpu_worker import decode_attention
from gpu_worker.attention import SequenceLayout
from gpu_worker.attention_cpu import CpuAttention
from gpu_worker.attention_reference import ReferenceAttention
from gpu_worker.decode_attention import (
    MIN_BLOCKS,
    CompiledDecodeAttention,
    DecodeInputs,
    compiled_decode_attention_or_none,
    paged_decode_attention,
    pool_blocks,
)
from gpu_worker.step_path import PAGED_ATTENTION_MIN_BLOCKS
from gpu_worker.unguarded_compile import GraphInputError
from tests.gpu_worker.attention_calls import count_attention_calls
from tests.gpu_worker.layouts import shuffled_layout

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
NUM_POOL_BLOCKS = 256


@pytest.fixture(scope="module")
def kernel() -> CompiledDecodeAttention:
    return CompiledDecodeAttention(
        NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK_SIZE, max_blocks=64, dtype=torch.float32
    )


def _pool(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_POOL_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return scale * torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _layout(rng: random.Random, shapes: list[tuple[int, int]]) -> list[SequenceLayout]:
    """(new tokens, cached tokens) per request, in shuffled blocks of the pool."""
    return shuffled_layout(rng, shapes, NUM_POOL_BLOCKS, BLOCK_SIZE)


def _reference(layout, queries, keys, values) -> torch.Tensor:
    reference = ReferenceAttention()
    return reference.attend(queries, keys, values, reference.prepare(layout, BLOCK_SIZE, CPU))


# Every offset within a block, the first position, and lengths of many blocks.
EDGES = [0, 1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 7 * BLOCK_SIZE - 1, 40]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_kv_heads", [NUM_HEADS, 1], ids=["mha", "mqa"])
def test_the_uncompiled_function_matches_the_reference(seed: int, num_kv_heads: int) -> None:
    rng = random.Random(seed)
    layout = _layout(rng, [(1, rng.choice(EDGES)) for _ in range(rng.randint(1, 9))])
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_POOL_BLOCKS * BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    queries = torch.randn(len(layout), NUM_HEADS, HEAD_DIM, generator=generator)
    # Padded with block 0 (past every position) to the longest table, as the backend does.
    width = max(MIN_BLOCKS, *(len(sequence.block_table) for sequence in layout))
    block_ids = torch.tensor(
        [s.block_table + [0] * (width - len(s.block_table)) for s in layout], dtype=torch.int64
    )
    positions = torch.tensor([s.num_cached_tokens for s in layout])

    actual = paged_decode_attention(
        queries,
        pool_blocks(keys, BLOCK_SIZE),
        pool_blocks(values, BLOCK_SIZE),
        block_ids,
        positions,
    )

    torch.testing.assert_close(actual, _reference(layout, queries, keys, values))


@pytest.mark.parametrize("seed", range(4))
def test_compiled_batches_of_decodes_match_the_reference(kernel, monkeypatch, seed: int) -> None:
    """Batches of 2 to 40 decodes at every edge length, and pools of another size
    than the warm-up's: one graph, the reference's result."""
    calls = count_attention_calls(monkeypatch, kernel)
    rng = random.Random(seed)
    layout = _layout(rng, [(1, rng.choice(EDGES[1:])) for _ in range(rng.randint(8, 40))])
    keys, values = _pool(seed)
    queries = torch.randn(
        len(layout), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)
    )
    backend = CpuAttention(decode_kernel=kernel)

    actual = backend.attend(queries, keys, values, backend.prepare(layout, BLOCK_SIZE, CPU))

    torch.testing.assert_close(actual, _reference(layout, queries, keys, values))
    assert [requests for requests, _ in calls] == [len(layout)]


def test_scores_far_apart_stay_finite_and_exact(kernel, monkeypatch) -> None:
    """Keys 10^4 times larger: scores of hundreds of thousands, one slot takes all the
    weight; no overflow (the largest score is subtracted before exp)."""
    calls = count_attention_calls(monkeypatch, kernel)
    layout = _layout(random.Random(9), [(1, 30), (1, 0), (1, 63), (1, 17)])
    keys, values = _pool(9, scale=1e4)
    queries = torch.randn(
        len(layout), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9)
    )
    backend = CpuAttention(decode_kernel=kernel)

    actual = backend.attend(queries, keys, values, backend.prepare(layout, BLOCK_SIZE, CPU))

    assert bool(torch.isfinite(actual).all())
    torch.testing.assert_close(actual, _reference(layout, queries, keys, values))
    assert len(calls) == 1


def test_decodes_beside_prompt_chunks_take_the_graph_and_the_chunks_sdpa(kernel, monkeypatch):
    """A mixed step in any row order: the decodes' rows through the graph, the chunks'
    through SDPA, each written back to its own rows."""
    calls = count_attention_calls(monkeypatch, kernel)
    shapes = [(1, 20), (5, 3), (1, 9), (1, 0), (7, 0), (1, 33), (1, 12), (2, 14)]
    layout = _layout(random.Random(4), shapes)
    keys, values = _pool(4)
    num_tokens = sum(num_query for num_query, _ in shapes)
    generator = torch.Generator().manual_seed(4)
    queries = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    backend = CpuAttention(decode_kernel=kernel)

    actual = backend.attend(queries, keys, values, backend.prepare(layout, BLOCK_SIZE, CPU))

    torch.testing.assert_close(actual, _reference(layout, queries, keys, values))
    num_decodes = sum(1 for num_query, _ in shapes if num_query == 1)
    assert [requests for requests, _ in calls] == [num_decodes]


@pytest.mark.parametrize(
    "shapes",
    [[(1, 60)], [(1, 2), (1, 5)], [(1, 1)] * ((PAGED_ATTENTION_MIN_BLOCKS - 1) // MIN_BLOCKS)],
    ids=["a lone decode", "two short decodes", "under the threshold"],
)
def test_steps_too_small_for_the_graph_take_sdpa(kernel, monkeypatch, shapes) -> None:
    """One request, or fewer blocks in all than PAGED_ATTENTION_MIN_BLOCKS: SDPA is as
    fast."""
    calls = count_attention_calls(monkeypatch, kernel)
    layout = _layout(random.Random(2), shapes)
    keys, values = _pool(2)
    queries = torch.randn(
        len(layout), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2)
    )
    backend = CpuAttention(decode_kernel=kernel)

    actual = backend.attend(queries, keys, values, backend.prepare(layout, BLOCK_SIZE, CPU))

    torch.testing.assert_close(actual, _reference(layout, queries, keys, values))
    assert calls == []


@pytest.mark.parametrize("num_decodes", [2, 5])
@pytest.mark.parametrize("after_a_chunk", [False, True], ids=["decodes", "mixed"])
def test_queries_as_the_rotary_split_view_match_the_reference(
    kernel, monkeypatch, num_decodes: int, after_a_chunk: bool
) -> None:
    """The forward hands attention its queries as a view of the rotated q/k tensor
    (rows (heads + kv_heads) * head_dim apart, not heads * head_dim), and takes the
    decodes' rows as a slice of it: each request gets its own queries' result. (A
    graph traced on contiguous queries, its guards skipped, once read request i's
    queries i * kv_heads * head_dim values too early: another request's data.)"""
    calls = count_attention_calls(monkeypatch, kernel)
    shapes = ([(6, 0)] if after_a_chunk else []) + [(1, 37 + 5 * i) for i in range(num_decodes)]
    layout = _layout(random.Random(num_decodes), shapes)
    keys, values = _pool(5)
    num_tokens = sum(num_query for num_query, _ in shapes)
    generator = torch.Generator().manual_seed(5)
    rotated = torch.randn(num_tokens, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM, generator=generator)
    queries, _ = rotated.split([NUM_HEADS, NUM_KV_HEADS], dim=1)
    assert not queries.is_contiguous()
    backend = CpuAttention(decode_kernel=kernel)

    actual = backend.attend(queries, keys, values, backend.prepare(layout, BLOCK_SIZE, CPU))

    expected = _reference(layout, queries.contiguous(), keys, values)
    torch.testing.assert_close(actual, expected)
    assert [requests for requests, _ in calls] == [num_decodes]


def test_the_graph_takes_the_sizes_it_was_compiled_for(kernel) -> None:
    """Requests and blocks within the compiled ranges; one request or too many blocks not."""
    assert kernel.takes(8, 4)
    assert kernel.takes(2, MIN_BLOCKS)
    assert not kernel.takes(1, 64)
    assert not kernel.takes(8, kernel.max_blocks + 1)
    assert not kernel.takes(8, MIN_BLOCKS - 1)


def _inputs(num_requests: int, num_blocks: int) -> DecodeInputs:
    return DecodeInputs(
        block_ids=torch.zeros(num_requests, num_blocks, dtype=torch.int64),
        positions=torch.zeros(num_requests, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    "queries, keys, inputs, reason",
    [
        (torch.zeros(8, 2 * NUM_HEADS, HEAD_DIM), None, None, "shape"),
        (None, torch.zeros(NUM_POOL_BLOCKS * BLOCK_SIZE, 1, HEAD_DIM), None, "shape"),
        (torch.zeros(8, NUM_HEADS, HEAD_DIM).double(), None, None, "float64"),
        (None, None, DecodeInputs(torch.zeros(8, 4), torch.zeros(8, dtype=torch.int64)), "float"),
        (None, None, DecodeInputs(torch.zeros(8, 8, dtype=torch.int64)[:, ::2],
                                  torch.zeros(8, dtype=torch.int64)), "not contiguous"),
        # Past a dynamic size's range: fewer requests, more blocks than compiled for.
        (torch.zeros(1, NUM_HEADS, HEAD_DIM), None, _inputs(1, 4), "shape"),
        (None, None, _inputs(8, 65), "shape"),
    ],
    ids=["other heads", "other kv heads", "other dtype", "float block ids", "strided block ids",
         "one request", "past max blocks"],
)  # fmt: skip
def test_inputs_unlike_the_compiled_ones_are_refused_at_the_boundary(
    kernel, queries, keys, inputs, reason
) -> None:
    """It runs without dynamo's guards, so its boundary checks what the graph was
    compiled for and raises rather than read the wrong elements."""
    good_queries = torch.zeros(8, NUM_HEADS, HEAD_DIM)
    good_keys = torch.zeros(NUM_POOL_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    assert kernel(good_queries, good_keys, good_keys, _inputs(8, 4)).shape == good_queries.shape
    queries = good_queries if queries is None else queries
    keys = good_keys if keys is None else keys
    with pytest.raises(GraphInputError, match=reason):
        kernel(queries, keys, keys, _inputs(8, 4) if inputs is None else inputs)


def _refused(monkeypatch, fake_compile) -> str:
    monkeypatch.setattr(decode_attention.torch, "compile", fake_compile)
    with capture_logs() as logs:
        kernel = compiled_decode_attention_or_none(
            NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, 512, BLOCK_SIZE, torch.float32
        )
    assert kernel is None
    (line,) = [entry for entry in logs if entry["event"] == "decode_attention_not_compiled"]
    return line["reason"]


def test_a_compile_that_fails_is_refused_with_its_reason(monkeypatch) -> None:
    def no_compiler(fn, **options):
        def fail(*args):
            raise RuntimeError("no working C++ compiler found")

        return fail

    assert "no working C++ compiler" in _refused(monkeypatch, no_compiler)


def test_a_compile_that_strays_is_refused(monkeypatch) -> None:
    assert "strays" in _refused(monkeypatch, lambda fn, **options: lambda *a: fn(*a) * 1.01)
