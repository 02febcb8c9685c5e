"""A layer's pointwise ops in three Triton kernels (see ``pointwise.py``).

- residual add + RMSNorm: one program per token row; the sum is stored in place;
- RoPE + K/V store: one program per token rotates its query heads into a new
  tensor and its key heads straight into the paged pool, with the values, at
  the token's slot (a negative slot stores nothing: CUDA-graph padding rows);
- SwiGLU: ``silu(gate) * up``, one program per row and column block.

Every kernel computes in fp32 and rounds to the model's dtype exactly where the
torch ops round (after a bf16 add, product or activation), so on a GPU bf16
results match ``TorchPointwise`` but for the order of the norm's sum. (Triton's
CPU interpreter truncates to bf16 instead of rounding to nearest, so the CPU
tests allow one bf16 step.)
"""

from __future__ import annotations

from typing import cast

import torch
import triton
import triton.language as tl

from gpu_worker.attention import KVWriter
from gpu_worker.rotary import RotaryEmbedding

_SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(
    hidden_ptr,  # [T, size]: read, and where HAS_DELTA, overwritten by hidden + delta
    delta_ptr,  # [T, size]
    weight_ptr,  # [size]
    normed_ptr,  # [T, size]
    hidden_stride,
    delta_stride,
    normed_stride,
    size,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < size
    hidden_row = hidden_ptr + row * hidden_stride + columns
    x = tl.load(hidden_row, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * delta_stride + columns, mask=mask, other=0.0)
        summed = (x + delta.to(tl.float32)).to(hidden_ptr.dtype.element_ty)
        tl.store(hidden_row, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / size
    normed = (x / tl.sqrt(mean_square + eps)).to(normed_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    scaled = (weight * normed.to(tl.float32)).to(normed_ptr.dtype.element_ty)
    tl.store(normed_ptr + row * normed_stride + columns, scaled, mask=mask)


@triton.jit
def _rotate_heads(
    source_ptr,  # this token's first head
    heads,  # [HEADS_PADDED, 1] head index
    head_mask,  # [HEADS_PADDED, 1]
    dims,  # [1, HEAD_DIM_PADDED]
    partner,  # [1, HEAD_DIM_PADDED]: the dim whose value rotates into each dim
    sign,  # [1, HEAD_DIM_PADDED]: -1 for the first half, +1 for the second
    cos,  # [1, HEAD_DIM_PADDED] fp32
    sin,  # [1, HEAD_DIM_PADDED] fp32
    HEAD_DIM: tl.constexpr,
):
    """``x * cos + rotate_half(x) * sin`` for ``heads``, rounded as torch rounds each op."""
    mask = head_mask & (dims < HEAD_DIM)
    x = tl.load(source_ptr + heads * HEAD_DIM + dims, mask=mask, other=0.0)
    rotated = tl.load(source_ptr + heads * HEAD_DIM + partner, mask=mask, other=0.0)
    dtype = x.dtype
    first = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    second = (rotated.to(tl.float32) * sign * sin).to(dtype).to(tl.float32)
    return (first + second).to(dtype), mask


@triton.jit
def _rope_and_store_kv_kernel(
    qkv_ptr,  # [T, (NUM_HEADS + 2 NUM_KV_HEADS) * HEAD_DIM]
    positions_ptr,  # [T] int64 or int32 (CUDA-graph inputs)
    cos_ptr,  # [max_positions, HEAD_DIM]
    sin_ptr,  # [max_positions, HEAD_DIM]
    slot_mapping_ptr,  # [T] int64 or int32; negative: store nothing
    query_ptr,  # [T, NUM_HEADS, HEAD_DIM] out
    key_pool_ptr,  # [slots, NUM_KV_HEADS, HEAD_DIM]
    value_pool_ptr,  # [slots, NUM_KV_HEADS, HEAD_DIM]
    qkv_stride,
    table_stride,
    pool_stride_slot,
    pool_stride_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    half = HEAD_DIM // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    sign = tl.where(dims < half, -1.0, 1.0)
    table_mask = dims < HEAD_DIM
    cos = tl.load(cos_ptr + position * table_stride + dims, mask=table_mask, other=0.0)
    sin = tl.load(sin_ptr + position * table_stride + dims, mask=table_mask, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    row = qkv_ptr + token * qkv_stride

    heads = tl.arange(0, HEADS_PADDED)[:, None]
    query, query_mask = _rotate_heads(
        row, heads, heads < NUM_HEADS, dims, partner, sign, cos, sin, HEAD_DIM
    )
    query_out = query_ptr + token * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    tl.store(query_out, query, mask=query_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        kv_heads = tl.arange(0, KV_HEADS_PADDED)[:, None]
        key, kv_mask = _rotate_heads(
            row + NUM_HEADS * HEAD_DIM,
            kv_heads,
            kv_heads < NUM_KV_HEADS,
            dims,
            partner,
            sign,
            cos,
            sin,
            HEAD_DIM,
        )
        value_row = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
        value = tl.load(value_row + kv_heads * HEAD_DIM + dims, mask=kv_mask, other=0.0)
        pool_offsets = slot * pool_stride_slot + kv_heads * pool_stride_head + dims
        tl.store(key_pool_ptr + pool_offsets, key, mask=kv_mask)
        tl.store(value_pool_ptr + pool_offsets, value, mask=kv_mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * size]: gate then up
    output_ptr,  # [T, size]
    gate_up_stride,
    output_stride,
    size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < size
    gate_row = gate_up_ptr + row * gate_up_stride
    gate = tl.load(gate_row + columns, mask=mask, other=0.0)
    up = tl.load(gate_row + size + columns, mask=mask, other=0.0).to(tl.float32)
    gate32 = gate.to(tl.float32)
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype).to(tl.float32)
    tl.store(
        output_ptr + row * output_stride + columns,
        (activated * up).to(output_ptr.dtype.element_ty),
        mask=mask,
    )


class TritonPointwise:
    """Three kernel launches per layer instead of about thirty."""

    name = "triton"

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_rows, size = hidden.shape
        assert hidden.stride(-1) == 1 and weight.is_contiguous()
        assert delta is None or (delta.shape == hidden.shape and delta.stride(-1) == 1)
        normed = torch.empty_like(hidden)
        if num_rows == 0:
            return hidden, normed
        _add_rms_norm_kernel[(num_rows,)](
            hidden,
            hidden if delta is None else delta,
            weight,
            normed,
            hidden.stride(0),
            0 if delta is None else delta.stride(0),
            normed.stride(0),
            size,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=triton.next_power_of_2(size),
        )
        return hidden, normed

    def rotary_inputs(
        self, rotary: RotaryEmbedding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rotary.cos, rotary.sin, positions

    def rope_and_store_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rotary_inputs: object,
        slot_mapping: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        write_kv: KVWriter,
    ) -> torch.Tensor:
        cos, sin, positions = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], rotary_inputs)
        num_tokens = qkv.shape[0]
        head_dim = keys.shape[-1]
        assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(-1) == 1
        assert keys.stride() == values.stride() and keys.stride(-1) == 1
        assert cos.is_contiguous() and sin.is_contiguous() and slot_mapping.is_contiguous()
        assert keys.dtype == qkv.dtype == cos.dtype
        query = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        if num_tokens == 0:
            return query
        _rope_and_store_kv_kernel[(num_tokens,)](
            qkv,
            positions,
            cos,
            sin,
            slot_mapping,
            query,
            keys,
            values,
            qkv.stride(0),
            cos.stride(0),
            keys.stride(0),
            keys.stride(1),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEADS_PADDED=triton.next_power_of_2(num_heads),
            KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        )
        return query

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        num_rows, double_size = gate_up.shape
        size = double_size // 2
        assert gate_up.stride(-1) == 1
        output = torch.empty((num_rows, size), dtype=gate_up.dtype, device=gate_up.device)
        if num_rows == 0:
            return output
        grid = (num_rows, triton.cdiv(size, _SILU_BLOCK))
        _silu_mul_kernel[grid](
            gate_up, output, gate_up.stride(0), output.stride(0), size, BLOCK=_SILU_BLOCK
        )
        return output
