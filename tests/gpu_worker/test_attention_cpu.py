"""The CPU backend's batched attention against the literal split/merge reference:
decodes and prompt chunks of every shape in one step, block tables of different
lengths in any order of the pool (the padding it builds for them must never
leak into a request's result)."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.attention import SequenceLayout, block_ids
from gpu_worker.attention_cpu import CpuAttention
from gpu_worker.attention_reference import ReferenceAttention
from tests.gpu_worker.layouts import shuffled_layout

CPU = torch.device("cpu")
BLOCK_SIZE = 4


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_a_mixed_step_matches_the_reference(seed: int, num_heads: int, num_kv_heads: int) -> None:
    rng = random.Random(seed)
    edges = [0, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 2]
    shapes = [(1, rng.choice(edges)) for _ in range(rng.randint(1, 9))]
    shapes += [(rng.randint(2, 11), rng.choice(edges)) for _ in range(rng.randint(0, 4))]
    rng.shuffle(shapes)  # decodes and chunks interleaved in the flattened batch
    num_blocks = 200
    layout = shuffled_layout(rng, shapes, num_blocks, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(seed)
    num_tokens, head_dim = sum(q for q, _ in shapes), 8
    queries = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    keys = torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    reference = ReferenceAttention()
    expected = reference.attend(queries, keys, values, reference.prepare(layout, BLOCK_SIZE, CPU))
    backend = CpuAttention(torch.float32)

    output = backend.attend(queries, keys, values, backend.prepare(layout, BLOCK_SIZE, CPU))

    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_block_tables_are_padded_with_block_zero_to_the_longest() -> None:
    layout = [SequenceLayout(0, 1, 4, [7, 3]), SequenceLayout(1, 1, 0, [5]),
              SequenceLayout(2, 2, 9, [1, 2, 9])]  # fmt: skip

    assert block_ids(layout, CPU).tolist() == [[7, 3, 0], [5, 0, 0], [1, 2, 9]]


def _attend_both(layout: list[SequenceLayout], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend's output and the reference's for ``layout`` (GQA, 4 over 2 heads)."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = sum(sequence.num_query_tokens for sequence in layout)
    num_blocks = 64
    queries = torch.randn(num_tokens, 4, 8, generator=generator)
    keys = torch.randn(num_blocks * BLOCK_SIZE, 2, 8, generator=generator)
    values = torch.randn(num_blocks * BLOCK_SIZE, 2, 8, generator=generator)
    reference = ReferenceAttention()
    expected = reference.attend(queries, keys, values, reference.prepare(layout, BLOCK_SIZE, CPU))
    backend = CpuAttention(torch.float32)
    return backend.attend(queries, keys, values, backend.prepare(layout, BLOCK_SIZE, CPU)), expected


@pytest.mark.parametrize("kind", ["consecutive", "reversed", "gap"])
@pytest.mark.parametrize(("num_query", "num_cached"), [(1, 9), (1, 0), (3, 6), (12, 0)])
def test_a_lone_request_reads_its_blocks_in_place_or_gathered_alike(
    kind: str, num_query: int, num_cached: int
) -> None:
    # Consecutive blocks are a view of the pool, others a copy: the same attention.
    num_blocks = -(-(num_query + num_cached) // BLOCK_SIZE)
    table = list(range(5, 5 + num_blocks))
    if kind == "reversed":
        table.reverse()
    elif kind == "gap":
        table[-1] += 1
    layout = [SequenceLayout(0, num_query, num_cached, table)]
    backend = CpuAttention(torch.float32)
    [group] = backend.prepare(layout, BLOCK_SIZE, CPU)
    in_place = kind == "consecutive" or num_blocks == 1
    assert (group.block_slice is not None) == in_place
    output, expected = _attend_both(layout)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_decodes_in_row_order_are_read_and_written_as_a_slice() -> None:
    # Two decodes at rows 0 and 1, a chunk at rows 2..6, a decode at row 7: the first
    # group is the three decodes, not in row order; with the chunk last, they are.
    scattered = [SequenceLayout(0, 1, 5, [1, 2]), SequenceLayout(1, 1, 0, [3]),
                 SequenceLayout(2, 5, 3, [4, 5]), SequenceLayout(7, 1, 8, [6, 7, 8])]  # fmt: skip
    in_order = [SequenceLayout(0, 1, 5, [1, 2]), SequenceLayout(1, 1, 0, [3]),
                SequenceLayout(2, 1, 8, [6, 7, 8]), SequenceLayout(3, 5, 3, [4, 5])]  # fmt: skip
    backend = CpuAttention(torch.float32)
    assert backend.prepare(scattered, BLOCK_SIZE, CPU)[0].row_slice is None
    assert backend.prepare(in_order, BLOCK_SIZE, CPU)[0].row_slice == (0, 3)
    for layout in (scattered, in_order):
        output, expected = _attend_both(layout, seed=len(layout))
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
