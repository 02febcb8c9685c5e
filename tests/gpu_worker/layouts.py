"""Step layouts for the attention tests: requests in shuffled blocks of a pool."""

from __future__ import annotations

import random

from gpu_worker.attention import SequenceLayout


def shuffled_layout(
    rng: random.Random, shapes: list[tuple[int, int]], num_blocks: int, block_size: int
) -> list[SequenceLayout]:
    """One request per (new tokens, cached tokens), in consecutive rows of the
    flattened batch, each holding blocks drawn at random from ``num_blocks``."""
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    layout, query_start = [], 0
    for num_query, num_cached in shapes:
        table = [free_blocks.pop() for _ in range(-(-(num_query + num_cached) // block_size))]
        layout.append(SequenceLayout(query_start, num_query, num_cached, table))
        query_start += num_query
    return layout
