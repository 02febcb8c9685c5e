"""Write a step's new K/V into the paged pool with one Triton launch (reshape-and-cache).

``index_copy_`` does the same in two launches (keys, values) and cannot skip
rows. Here one program copies one token's K and V for every K/V head, and a
negative slot means "skip": the padding rows of a CUDA-graph decode batch
(``cuda_graphs.py``) write nothing, so they need no slot of the pool and take
no block from the scheduler's budget.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PADDING_SLOT = -1  # a token whose K/V is not stored (CUDA-graph padding rows)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, kv_heads, head_dim]
    value_ptr,  # [T, kv_heads, head_dim]
    key_pool_ptr,  # [slots, kv_heads, head_dim]
    value_pool_ptr,  # [slots, kv_heads, head_dim]
    slot_mapping_ptr,  # [T] int64, or int32 (CUDA-graph inputs)
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    pool_stride_slot,
    pool_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, HEADS_PADDED)
        dims = tl.arange(0, HEAD_DIM_PADDED)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        pool_offsets = slot * pool_stride_slot + heads[:, None] * pool_stride_head + dims[None, :]
        key_offsets = token * key_stride_token + heads[:, None] * key_stride_head + dims[None, :]
        value_offsets = (
            token * value_stride_token + heads[:, None] * value_stride_head + dims[None, :]
        )
        key = tl.load(key_ptr + key_offsets, mask=mask)  # [HEADS_PADDED, HEAD_DIM_PADDED]
        value = tl.load(value_ptr + value_offsets, mask=mask)
        tl.store(key_pool_ptr + pool_offsets, key, mask=mask)
        tl.store(value_pool_ptr + pool_offsets, value, mask=mask)


def write_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Store ``key``/``value`` [T, kv_heads, head_dim] at pool rows ``slot_mapping`` [T].

    ``keys``/``values`` are one layer's pool [slots, kv_heads, head_dim]; rows
    whose slot is negative are skipped. Inputs may be strided views (the
    value is a slice of the fused QKV projection) but their last dim is dense.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and keys.shape[1:] == key.shape[1:]
    assert key.dtype == value.dtype == keys.dtype == values.dtype
    assert keys.stride() == values.stride() and slot_mapping.is_contiguous()
    assert key.stride(-1) == value.stride(-1) == keys.stride(-1) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        keys,
        values,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        keys.stride(0),
        keys.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )
