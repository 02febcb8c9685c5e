"""Reference attention: Orca's split/merge, literally, one SDPA call per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention import SequenceLayout, causal_mask, kv_slots


@dataclass(frozen=True)
class _RequestSlice:
    rows: slice
    slots: torch.Tensor  # [kv_tokens]
    mask: torch.Tensor | None  # [1, q, kv] or None when no masking is needed


class ReferenceAttention:
    """Split the flattened batch by request, attend each alone, merge back."""

    name = "reference"

    def prepare(
        self, layout: list[SequenceLayout], block_size: int, device: torch.device
    ) -> list[_RequestSlice]:
        """Each request's K/V slots and causal mask."""
        slices = []
        for sequence, slots in zip(layout, kv_slots(layout, block_size, device), strict=True):
            mask = None
            if sequence.num_query_tokens > 1:
                mask = causal_mask(
                    [sequence.num_query_tokens],
                    [sequence.num_cached_tokens],
                    sequence.num_kv_tokens,
                )[0].to(device)
            start = sequence.query_start
            slices.append(
                _RequestSlice(
                    rows=slice(start, start + sequence.num_query_tokens),
                    slots=slots[: sequence.num_kv_tokens],
                    mask=mask,
                )
            )
        return slices

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
        for request in prepared:
            query = queries[request.rows].transpose(0, 1)  # [heads, q, head_dim]
            key = keys.index_select(0, request.slots).transpose(0, 1)  # [kv_heads, kv, head_dim]
            value = values.index_select(0, request.slots).transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                query, key, value, attn_mask=request.mask, enable_gqa=True
            )
            output[request.rows] = attended.transpose(0, 1)
        return output
