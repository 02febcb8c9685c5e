"""Counting the calls a compiled decode attention takes, for tests of who uses it."""

from __future__ import annotations

import pytest

from gpu_worker.decode_attention import CompiledDecodeAttention


def count_attention_calls(
    monkeypatch: pytest.MonkeyPatch, kernel: CompiledDecodeAttention
) -> list[tuple[int, int]]:
    """(requests, blocks each) of every call the kernel's graph takes from now on."""
    calls: list[tuple[int, int]] = []
    compiled = kernel._compiled

    def counted(queries, key_blocks, value_blocks, block_ids, positions):
        calls.append(tuple(block_ids.shape))
        return compiled(queries, key_blocks, value_blocks, block_ids, positions)

    monkeypatch.setattr(kernel, "_compiled", counted)
    return calls
