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

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def _layout(rng: random.Random, shapes: list[tuple[int, int]], num_blocks: int):
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    layout, query_start = [], 0
    for num_query, num_cached in shapes:
        table = [free_blocks.pop() for _ in range(-(-(num_query + num_cached) // BLOCK_SIZE))]
        layout.append(SequenceLayout(query_start, num_query, num_cached, table))
        query_start += num_query
    return layout


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_a_mixed_step_matches_the_reference(seed: int, num_heads: int, num_kv_heads: int) -> None:
    rng = random.Random(seed)
    edges = [0, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 2]
    shapes = [(1, rng.choice(edges)) for _ in range(rng.randint(1, 9))]
    shapes += [(rng.randint(2, 11), rng.choice(edges)) for _ in range(rng.randint(0, 4))]
    rng.shuffle(shapes)  # decodes and chunks interleaved in the flattened batch
    num_blocks = 200
    layout = _layout(rng, shapes, num_blocks)
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
