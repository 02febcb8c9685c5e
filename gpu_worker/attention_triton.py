"""Paged attention in one Triton kernel: every request of a mixed step at once.

One program handles one *tile* of a request's new query tokens against one
K/V head. Its rows are ``tile_tokens x queries_per_kv`` (token, query head)
pairs, so the query heads that share a K/V head (grouped-query attention)
read each K/V tile once. It walks the request's K/V ``BLOCK_N`` tokens at a
time through the block table (online softmax, fp32 accumulators) up to the
last position its tile may see; causality among the new tokens is the mask
``key_position <= query_position``. Prompt chunks and decodes share the
launch: a tile is a list entry built in ``prepare``, not a grid coordinate
derived from the longest request, so nothing is padded to the longest prompt.

Decode-only steps use one-token tiles (``BLOCK_Q = 1``); steps with prompt
chunks use ``prefill_tile_tokens`` per tile. All launch parameters come from
tensor shapes and compile-time constants, so a decode step can be captured
in a CUDA graph (``cuda_graphs.py``) and replayed with new table contents.

Under ``TRITON_INTERPRET=1`` (the CPU tests) Triton's interpreter keeps bf16
as raw 16-bit integers and does arithmetic and ``tl.dot`` on those bits, so
there the kernel converts every operand to fp32 first (``DOT_IN_FP32``); P is
still rounded to the K/V dtype before ``P @ V``, as on the GPU. fp32 models
use IEEE fp32 dots (not TF32) so they match the reference to ~1e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from gpu_worker.attention import SequenceLayout
from gpu_worker.kv_write_triton import write_kv

# Columns of the request table before each request's block table.
QUERY_START, NUM_QUERY_TOKENS, NUM_CACHED_TOKENS, FIRST_BLOCK_COLUMN = 0, 1, 2, 3
# A compiled kernel may read a global only when it is a constexpr.
_FIRST_BLOCK_COLUMN_IN_KERNEL = tl.constexpr(FIRST_BLOCK_COLUMN)
_MIN_DOT_SIZE = 16  # tl.dot needs every dimension >= 16 on NVIDIA GPUs


@triton.jit
def _paged_attention_kernel(
    output_ptr,  # [T, heads, head_dim]
    query_ptr,  # [T, heads, head_dim]
    key_pool_ptr,  # [slots, kv_heads, head_dim]
    value_pool_ptr,  # [slots, kv_heads, head_dim]
    requests_ptr,  # [B, 3 + max_blocks] int32: query_start, num_query, num_cached, blocks...
    tiles_ptr,  # [num_tiles, 2] int32: request row, first query token of the tile in it
    requests_row_stride,
    query_stride_token,
    query_stride_head,
    output_stride_token,
    output_stride_head,
    pool_stride_slot,
    pool_stride_head,
    scale_log2,  # softmax scale times log2(e): the kernel uses exp2
    BLOCK_SIZE: tl.constexpr,  # tokens per K/V block of the pool
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PADDED: tl.constexpr,  # QUERIES_PER_KV rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile: >= BLOCK_Q * GROUP_PADDED and >= 16
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(tiles_ptr + tile * 2)
    tile_first_token = tl.load(tiles_ptr + tile * 2 + 1)
    request_row = requests_ptr + request.to(tl.int64) * requests_row_stride
    query_start = tl.load(request_row + 0)
    num_query = tl.load(request_row + 1)
    num_cached = tl.load(request_row + 2)

    rows = tl.arange(0, BLOCK_M)
    token_in_tile = rows // GROUP_PADDED
    head_in_group = rows % GROUP_PADDED
    token = tile_first_token + token_in_tile  # [BLOCK_M] index among the request's new tokens
    row_valid = (token_in_tile < BLOCK_Q) & (token < num_query) & (head_in_group < QUERIES_PER_KV)
    head = kv_head * QUERIES_PER_KV + head_in_group
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    row_token = (query_start + token).to(tl.int64)

    query_offsets = row_token[:, None] * query_stride_token + head[:, None] * query_stride_head
    query_mask = row_valid[:, None] & dim_valid[None, :]
    query = tl.load(query_ptr + query_offsets + dims[None, :], mask=query_mask, other=0.0)
    if DOT_IN_FP32:
        query = query.to(tl.float32)  # [BLOCK_M, HEAD_DIM_PADDED]
    query_position = num_cached + token  # [BLOCK_M]

    # The tile's last query sees keys up to its own position; nothing beyond is read.
    num_keys = num_cached + tl.minimum(tile_first_token + BLOCK_Q, num_query)
    # Finite start: a row masked in every tile so far keeps p = 0 instead of NaN.
    running_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    key_index = tl.arange(0, BLOCK_N)
    head_offset = kv_head.to(tl.int64) * pool_stride_head
    for key_start in range(0, num_keys, BLOCK_N):
        key_position = key_start + key_index  # [BLOCK_N]
        key_valid = key_position < num_keys
        block = tl.load(
            request_row + _FIRST_BLOCK_COLUMN_IN_KERNEL + key_position // BLOCK_SIZE,
            mask=key_valid,
            other=0,
        )
        slot = block.to(tl.int64) * BLOCK_SIZE + key_position % BLOCK_SIZE  # [BLOCK_N]
        kv_offsets = slot * pool_stride_slot + head_offset
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        key = tl.load(
            key_pool_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0
        )  # [BLOCK_N, HEAD_DIM_PADDED]
        value = tl.load(
            value_pool_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0
        )
        if DOT_IN_FP32:
            scores = tl.dot(query, tl.trans(key.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(query, tl.trans(key))
        scores = scores * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = key_valid[None, :] & (key_position[None, :] <= query_position[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        probabilities = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probabilities, 1)
        probabilities = probabilities.to(value.dtype)  # as flash attention: P @ V in K/V dtype
        if DOT_IN_FP32:
            update = tl.dot(
                probabilities.to(tl.float32), value.to(tl.float32), input_precision="ieee"
            )
        else:
            update = tl.dot(probabilities, value)
        accumulator = accumulator * rescale[:, None] + update
        running_max = new_max

    # Only padding rows can end with no visible key (every real query sees key 0): avoid 0/0.
    running_sum = tl.where(running_sum > 0, running_sum, 1.0)
    attended = accumulator / running_sum[:, None]
    output_offsets = row_token[:, None] * output_stride_token + head[:, None] * output_stride_head
    tl.store(
        output_ptr + output_offsets + dims[None, :],
        attended.to(output_ptr.dtype.element_ty),
        mask=query_mask,
    )


def kernels_are_interpreted() -> bool:
    """True when Triton built these kernels for its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return isinstance(_paged_attention_kernel, InterpretedFunction)


@dataclass(frozen=True)
class TritonPlan:
    """One step's layout as device tensors; every layer's launch reads it.

    ``requests`` and ``tiles`` may be views of static buffers that a CUDA
    graph replays with new contents (``cuda_graphs.py``).
    """

    requests: torch.Tensor  # [B, 3 + max_blocks] int32, columns as in request_table
    tiles: torch.Tensor  # [num_tiles, 2] int32: request row, first query token of the tile
    block_size: int
    tile_tokens: int  # query tokens per tile (BLOCK_Q)


def request_table(layout: list[SequenceLayout]) -> np.ndarray:
    """``[B, 3 + max_blocks]`` int32: query_start, num_query_tokens, num_cached_tokens,
    then the block table padded with block 0 (never read: the kernel stops at the last key)."""
    width = max(len(sequence.block_table) for sequence in layout)
    # Rows as lists, one array at the end: no numpy op per request (host work
    # on the GPU's critical path, growing with the batch).
    assert (QUERY_START, NUM_QUERY_TOKENS, NUM_CACHED_TOKENS) == (0, 1, 2)
    flat: list[int] = []
    for s in layout:
        flat += (s.query_start, s.num_query_tokens, s.num_cached_tokens)
        flat += s.block_table
        flat += [0] * (width - len(s.block_table))
    # fromiter: about twice as fast as np.array over a list of ints.
    table = np.fromiter(flat, dtype=np.int32, count=len(flat))
    return table.reshape(len(layout), FIRST_BLOCK_COLUMN + width)


def query_tiles(layout: list[SequenceLayout], tile_tokens: int) -> np.ndarray:
    """``[num_tiles, 2]`` int32: each tile's request row and its first query token."""
    # Tiles per request, then one repeat: no Python loop over the tiles.
    counts = np.array([-(-s.num_query_tokens // tile_tokens) for s in layout], dtype=np.int32)
    rows = np.repeat(np.arange(len(layout), dtype=np.int32), counts)
    # Each tile's index within its request: a running count reset at each request.
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    firsts = (np.arange(len(rows), dtype=np.int32) - starts) * tile_tokens
    return np.stack([rows, firsts.astype(np.int32)], axis=1).reshape(-1, 2)


class TritonAttention:
    """All requests of a step in one paged-attention launch per layer; K/V written by a kernel."""

    name = "triton"

    def __init__(
        self, dtype: torch.dtype = torch.bfloat16, prefill_tile_tokens: int = 16, block_n: int = 64
    ) -> None:
        if block_n < _MIN_DOT_SIZE or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        if prefill_tile_tokens < 1:
            raise ValueError(f"prefill_tile_tokens must be >= 1, got {prefill_tile_tokens}")
        self.dtype = dtype
        self.prefill_tile_tokens = prefill_tile_tokens
        self.block_n = block_n

    def prepare(
        self, layout: list[SequenceLayout], block_size: int, device: torch.device
    ) -> TritonPlan:
        """Request table and query tiles, copied to the device once for every layer."""
        decode_only = all(sequence.num_query_tokens == 1 for sequence in layout)
        tile_tokens = 1 if decode_only else self.prefill_tile_tokens
        requests = torch.from_numpy(request_table(layout))
        tiles = torch.from_numpy(query_tiles(layout, tile_tokens))
        return TritonPlan(
            requests=requests.to(device, non_blocking=True),
            tiles=tiles.to(device, non_blocking=True),
            block_size=block_size,
            tile_tokens=tile_tokens,
        )

    def attend(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prepared: object
    ) -> torch.Tensor:
        """Attention of every request over its own cached plus new K/V."""
        output = torch.empty_like(queries)  # [T, heads, head_dim]
        self.attend_into(output, queries, keys, values, prepared)
        return output

    def attend_into(
        self,
        output: torch.Tensor,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        prepared: object,
    ) -> None:
        """``attend`` writing into ``output`` [T, heads, head_dim] (every element of it)."""
        assert isinstance(prepared, TritonPlan)
        _num_tokens, num_heads, head_dim = queries.shape
        _num_slots, num_kv_heads, _ = keys.shape
        assert keys.stride() == values.stride() and keys.stride(-1) == 1
        assert queries.stride(-1) == 1 and output.stride(-1) == 1
        queries_per_kv = num_heads // num_kv_heads
        group_padded = triton.next_power_of_2(queries_per_kv)
        block_m = max(_MIN_DOT_SIZE, prepared.tile_tokens * group_padded)
        interpreted = kernels_are_interpreted()
        grid = (prepared.tiles.shape[0], num_kv_heads)
        _paged_attention_kernel[grid](
            output,
            queries,
            keys,
            values,
            prepared.requests,
            prepared.tiles,
            prepared.requests.stride(0),
            queries.stride(0),
            queries.stride(1),
            output.stride(0),
            output.stride(1),
            keys.stride(0),
            keys.stride(1),
            math.log2(math.e) / math.sqrt(head_dim),
            BLOCK_SIZE=prepared.block_size,
            QUERIES_PER_KV=queries_per_kv,
            GROUP_PADDED=group_padded,
            BLOCK_Q=prepared.tile_tokens,
            BLOCK_M=block_m,
            BLOCK_N=self.block_n,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=max(_MIN_DOT_SIZE, triton.next_power_of_2(head_dim)),
            DOT_IN_FP32=interpreted or keys.dtype == torch.float32,
        )

    def write_kv(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Store this step's ``key``/``value`` [T, kv_heads, head_dim] at ``slot_mapping``."""
        write_kv(keys, values, slot_mapping, key, value)
