"""Vectorised attention for the CPU: all requests in a few ops from the block tables.

Decoding requests (one new token each) are one batched SDPA call over their
gathered, padded K/V; prompt chunks are a second call padded to the longest
chunk. Splitting the two keeps a long prefill from padding every decode's
query to its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention import SequenceLayout, causal_mask, kv_slots


@dataclass(frozen=True)
class _Group:
    """Requests attended together: their query rows padded to ``[B, max_q]``."""

    query_rows: torch.Tensor  # [B, max_q] rows of the flattened batch (padding: row 0)
    valid: torch.Tensor  # [B, max_q] bool, False on padding
    kv_slots: torch.Tensor  # [B, max_kv]
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool
    output_rows: torch.Tensor  # [num_valid] rows the valid queries come from


def _group(layout: list[SequenceLayout], block_size: int, device: torch.device) -> _Group:
    max_query_tokens = max(sequence.num_query_tokens for sequence in layout)
    query_rows = torch.zeros((len(layout), max_query_tokens), dtype=torch.int64)
    valid = torch.zeros((len(layout), max_query_tokens), dtype=torch.bool)
    for row, sequence in enumerate(layout):
        count = sequence.num_query_tokens
        query_rows[row, :count] = torch.arange(sequence.query_start, sequence.query_start + count)
        valid[row, :count] = True
    slots = kv_slots(layout, block_size, device)
    mask = causal_mask(
        [s.num_query_tokens for s in layout], [s.num_cached_tokens for s in layout], slots.shape[1]
    )
    return _Group(
        query_rows=query_rows.to(device),
        valid=valid.to(device),
        kv_slots=slots,
        mask=mask.to(device),
        output_rows=query_rows[valid].to(device),
    )


class CpuAttention:
    """Two batched SDPA calls per layer: decodes, then prompt chunks."""

    name = "cpu"

    def prepare(
        self, layout: list[SequenceLayout], block_size: int, device: torch.device
    ) -> list[_Group]:
        """Gather indices and masks for the decode group and the prefill group."""
        decodes = [s for s in layout if s.num_query_tokens == 1]
        prefills = [s for s in layout if s.num_query_tokens > 1]
        return [_group(part, block_size, device) for part in (decodes, prefills) if part]

    def attend(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        prepared: object,
    ) -> torch.Tensor:
        """Attention of every request over its own cached plus new K/V."""
        assert isinstance(prepared, list)
        output = torch.empty_like(queries)  # [T, heads, head_dim]
        for group in prepared:
            query = queries[group.query_rows].transpose(1, 2)  # [B, heads, max_q, head_dim]
            key = keys[group.kv_slots].transpose(1, 2)  # [B, kv_heads, max_kv, head_dim]
            value = values[group.kv_slots].transpose(1, 2)
            attended = F.scaled_dot_product_attention(
                query, key, value, attn_mask=group.mask, enable_gqa=True
            )  # [B, heads, max_q, head_dim]
            output[group.output_rows] = attended.transpose(1, 2)[group.valid]
        return output
