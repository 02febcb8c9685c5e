"""Attention backends: the one per-request op of a selective-batched step.

Every other op runs once over the flattened ``[T, hidden]`` tokens of all
requests; attention needs request boundaries (Orca's split/merge). A backend
gets the step's layout once (``prepare``), then is called per layer with that
layer's queries and K/V pool. All backends give the same result as
``reference`` (the literal split/merge with torch SDPA); ``cpu`` does all
requests in a few vectorised ops. A Triton backend for CUDA plugs in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SequenceLayout:
    """One request's slice of a step.

    Its new tokens are rows ``[query_start, query_start + num_query_tokens)``
    of the flattened batch, at positions after ``num_cached_tokens`` tokens
    already in the cache; ``block_table`` covers all of them.
    """

    query_start: int
    num_query_tokens: int
    num_cached_tokens: int
    block_table: list[int]

    @property
    def num_kv_tokens(self) -> int:
        """Tokens this request's new queries attend over (cached plus new)."""
        return self.num_cached_tokens + self.num_query_tokens


def kv_slots(layout: list[SequenceLayout], block_size: int, device: torch.device) -> torch.Tensor:
    """Slot of every K/V token of each request, padded with slot 0: ``[B, max_kv_tokens]``."""
    tables = block_ids(layout, device)
    offsets = torch.arange(block_size, dtype=torch.int64, device=device)
    slots = (tables.unsqueeze(-1) * block_size + offsets).flatten(1)  # [B, max_blocks * bs]
    max_kv_tokens = max(sequence.num_kv_tokens for sequence in layout)
    return slots[:, :max_kv_tokens]


def block_ids(layout: list[SequenceLayout], device: torch.device) -> torch.Tensor:
    """Each request's block table padded with block 0: ``[B, max_blocks]``."""
    max_blocks = max(len(sequence.block_table) for sequence in layout)
    tables = torch.zeros((len(layout), max_blocks), dtype=torch.int64)
    for row, sequence in enumerate(layout):
        tables[row, : len(sequence.block_table)] = torch.tensor(sequence.block_table)
    return tables.to(device)


def causal_mask(
    num_query_tokens: list[int], num_cached_tokens: list[int], max_kv_tokens: int
) -> torch.Tensor:
    """``[B, 1, max_q, max_kv]`` bool: query i of a request sees keys ``<= cached + i``.

    Padded query rows see key 0 only, so softmax never meets an all-masked row.
    """
    max_query_tokens = max(num_query_tokens)
    query_index = torch.arange(max_query_tokens).view(1, -1, 1)
    key_index = torch.arange(max_kv_tokens).view(1, 1, -1)
    cached = torch.tensor(num_cached_tokens).view(-1, 1, 1)
    valid_query = query_index < torch.tensor(num_query_tokens).view(-1, 1, 1)
    visible = key_index <= cached + query_index
    return torch.where(valid_query, visible, key_index == 0).unsqueeze(1)


class AttentionBackend(Protocol):
    """Attention over paged K/V for all requests of one step."""

    name: str

    def prepare(
        self, layout: list[SequenceLayout], block_size: int, device: torch.device
    ) -> object:
        """Per-step work shared by every layer (indices, masks)."""
        ...

    def attend(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prepared: object
    ) -> torch.Tensor:
        """``queries`` [T, heads, head_dim] against one layer's pool ``keys``/``values``
        [slots, kv_heads, head_dim] (this step's K/V already written) -> [T, heads, head_dim]."""
        ...


BACKEND_NAMES = ("reference", "cpu")


def make_backend(name: str, dtype: torch.dtype) -> AttentionBackend:
    """The backend called ``name`` (one of BACKEND_NAMES) computing in ``dtype``."""
    from gpu_worker.attention_cpu import CpuAttention
    from gpu_worker.attention_reference import ReferenceAttention

    if name == "reference":
        return ReferenceAttention()
    if name == "cpu":
        return CpuAttention(dtype)
    raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKEND_NAMES)}")


def default_backend_name(device: torch.device) -> str:
    """The fastest backend available on ``device``."""
    return "cpu"
