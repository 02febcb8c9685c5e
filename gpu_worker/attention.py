"""Attention backends: the one per-request op of a selective-batched step.

Every other op runs once over the flattened ``[T, hidden]`` tokens of all
requests; attention needs request boundaries (Orca's split/merge). A backend
gets the step's layout once (``prepare``), then is called per layer with that
layer's queries and K/V pool. All backends give the same result as
``reference`` (the literal split/merge with torch SDPA); ``cpu`` does all
requests in a few vectorised ops; ``triton`` (CUDA) does all of them in one
paged kernel launch per layer and writes the new K/V with a kernel too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from gpu_worker.decode_attention import CompiledDecodeAttention


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


def decodes_within(layout: list[SequenceLayout], max_blocks: int) -> bool:
    """Whether every request of the step has one new token (a decode) and a block
    table of at most ``max_blocks``: what the decode runners' graphs take."""
    return all(
        sequence.num_query_tokens == 1 and len(sequence.block_table) <= max_blocks
        for sequence in layout
    )


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
    # Padded as lists and made one tensor: no torch op per request (host work
    # that grew with the batch).
    rows = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in layout]
    return torch.tensor(rows, dtype=torch.int64).to(device)


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


# keys, values (one layer's pool), slot_mapping [T], key, value [T, kv_heads, head_dim]
KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _index_copy_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    keys.index_copy_(0, slot_mapping, key)
    values.index_copy_(0, slot_mapping, value)


def kv_writer(backend: AttentionBackend) -> KVWriter:
    """How this step's K/V reach the pool: the backend's ``write_kv`` if it has one
    (a fused kernel), else ``index_copy_``. Looked up once per forward, not per layer."""
    writer: KVWriter | None = getattr(backend, "write_kv", None)
    return writer if writer is not None else _index_copy_kv


# Backends that run on every device, the CPU included (what CPU benchmarks sweep).
BACKEND_NAMES = ("reference", "cpu")
# Backends that need a CUDA GPU (on the CPU only under TRITON_INTERPRET=1, for tests).
CUDA_BACKEND_NAMES = ("triton",)


class BackendUnavailableError(RuntimeError):
    """The named attention backend cannot run here (its package is not installed)."""


def triton_available() -> bool:
    """True when the ``triton`` package imports (Linux wheels; needed for the CUDA backend)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(
    name: str, dtype: torch.dtype, decode_kernel: CompiledDecodeAttention | None = None
) -> AttentionBackend:
    """The backend called ``name`` (BACKEND_NAMES or CUDA_BACKEND_NAMES) computing in
    ``dtype``; ``cpu`` runs batched decodes through ``decode_kernel`` where given."""
    from gpu_worker.attention_cpu import CpuAttention
    from gpu_worker.attention_reference import ReferenceAttention

    if name == "reference":
        return ReferenceAttention()
    if name == "cpu":
        return CpuAttention(dtype, decode_kernel)
    if name == "triton":
        if not triton_available():
            raise BackendUnavailableError(
                "attention backend 'triton' needs the triton package (pip install triton; "
                "Linux only); use 'cpu' or 'reference' instead"
            )
        from gpu_worker.attention_triton import TritonAttention

        return TritonAttention(dtype)
    known = ", ".join(BACKEND_NAMES + CUDA_BACKEND_NAMES)
    raise ValueError(f"attention backend {name!r} is not one of {known}")


def default_backend_name(device: torch.device) -> str:
    """The fastest backend available on ``device``: ``triton`` on CUDA when it imports."""
    if device.type == "cuda" and triton_available():
        return "triton"
    return "cpu"
