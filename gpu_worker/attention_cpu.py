"""Vectorised attention for the CPU: all requests in a few ops from the block tables.

Decoding requests (one new token each) are one batched call: the compiled
paged attention (``decode_attention.py``), which reads their blocks in the
pool, where the engine has one and the step's path takes it
(``step_path.takes_paged_attention``), else one SDPA call
over their gathered, padded K/V; prompt chunks are a second SDPA call padded
to the longest chunk. Splitting the two keeps a long prefill from padding
every decode's query to its length.

Three choices make this as fast as attention over a contiguous static cache
(measured in bench/engine.py and bench/profile_engine.py): K/V are gathered
whole blocks at a time (one ``index_select`` of ``block_size * kv_heads *
head_dim`` rows, several times faster than per-token indexing), into buffers
kept from layer to layer and step to step (a fresh tensor per layer cost
more in page faults than the copy itself), and the mask is additive in the
compute dtype (torch's CPU SDPA takes a much slower path for a boolean mask
over strided K/V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention import SequenceLayout, block_ids, causal_mask
from gpu_worker.decode_attention import CompiledDecodeAttention, DecodeInputs, decode_inputs
from gpu_worker.step_path import takes_paged_attention

_SHRINK_FACTOR = 4


@dataclass(frozen=True)
class _Group:
    """Requests attended together: their query rows padded to ``[B, max_q]``."""

    query_rows: torch.Tensor  # [B, max_q] rows of the flattened batch (padding: row 0)
    valid: torch.Tensor  # [B, max_q] bool, False on padding
    block_ids: torch.Tensor  # [B * max_blocks] flattened, gathered in one index_select
    block_size: int
    num_kv_slots: int  # max_blocks * block_size
    additive_mask: torch.Tensor  # [B, 1, max_q, num_kv_slots], 0 or -inf
    output_rows: torch.Tensor  # [num_valid] rows the valid queries come from
    # (first, end) when the group's queries are exactly rows first..end - 1 in
    # order, one per request (decodes, as plans lay them out): they are read
    # and written as a slice, without the index ops (tens of microseconds a
    # layer, most of a batch-1 decode's attention).
    row_slice: tuple[int, int] | None
    # (first, count) when the group is one request whose blocks are consecutive
    # (a lone chat, as the ledger hands out blocks): its K/V is read in place,
    # a view of the pool, instead of copied.
    block_slice: tuple[int, int] | None
    # For the compiled paged attention (decodes only, where the step's path takes it:
    # ``step_path.takes_paged_attention``).
    decode_inputs: DecodeInputs | None = None


def _group(
    layout: list[SequenceLayout],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    decode_kernel: CompiledDecodeAttention | None = None,
) -> _Group:
    num_query_tokens = [sequence.num_query_tokens for sequence in layout]
    # Whole-batch ops, no torch op per request: row r holds query_start + 0, 1, ...
    # for its num_query_tokens columns, padding (row 0) after.
    columns = torch.arange(max(num_query_tokens), dtype=torch.int64)
    valid = columns < torch.tensor(num_query_tokens, dtype=torch.int64).unsqueeze(1)
    starts = torch.tensor([sequence.query_start for sequence in layout], dtype=torch.int64)
    query_rows = torch.where(valid, starts.unsqueeze(1) + columns, 0)
    tables = block_ids(layout, device)
    num_kv_slots = tables.shape[1] * block_size
    visible = causal_mask(num_query_tokens, [s.num_cached_tokens for s in layout], num_kv_slots)
    additive_mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))
    first = layout[0].query_start
    in_order = all(
        sequence.num_query_tokens == 1 and sequence.query_start == first + index
        for index, sequence in enumerate(layout)
    )
    table = layout[0].block_table
    consecutive = (
        len(layout) == 1 and bool(table) and table == list(range(table[0], table[0] + len(table)))
    )
    paged = max(num_query_tokens) == 1 and takes_paged_attention(decode_kernel, layout)
    return _Group(
        query_rows=query_rows.to(device),
        valid=valid.to(device),
        block_ids=tables.flatten(),
        block_size=block_size,
        num_kv_slots=num_kv_slots,
        additive_mask=additive_mask.to(device),
        output_rows=query_rows[valid].to(device),
        row_slice=(first, first + len(layout)) if in_order else None,
        block_slice=(table[0], len(table)) if consecutive else None,
        decode_inputs=decode_inputs(layout, device) if paged else None,
    )


class CpuAttention:
    """Two batched calls per layer: decodes, then prompt chunks."""

    name = "cpu"

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        decode_kernel: CompiledDecodeAttention | None = None,
    ) -> None:
        """``decode_kernel``: the compiled decode attention, for steps of two decodes
        or more (None: SDPA over copied blocks for every group)."""
        self.dtype = dtype
        self.decode_kernel = decode_kernel
        # Gather buffers, by (group, keys or values): grown as needed, and
        # shrunk once far larger than what a step needs.
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    def _gather(self, cache: torch.Tensor, group: _Group, slot: tuple[int, int]) -> torch.Tensor:
        """The group's blocks of ``cache``: a view where they are consecutive, else
        copied into the buffer of ``slot``."""
        blocks = cache.view(cache.shape[0] // group.block_size, -1)
        if group.block_slice is not None:
            first, count = group.block_slice
            return blocks[first : first + count]
        ids = group.block_ids
        buffer = self._buffers.get(slot)
        if (
            buffer is None
            or buffer.shape[0] < len(ids)
            # Far larger than needed now (after a burst): give the memory back.
            or buffer.shape[0] > _SHRINK_FACTOR * len(ids)
            or buffer.shape[1] != blocks.shape[1]
            or buffer.dtype != blocks.dtype
            or buffer.device != blocks.device
        ):
            buffer = torch.empty(
                (len(ids), blocks.shape[1]), dtype=blocks.dtype, device=blocks.device
            )
            self._buffers[slot] = buffer
        out = buffer[: len(ids)]
        torch.index_select(blocks, 0, ids, out=out)
        return out

    def prepare(
        self, layout: list[SequenceLayout], block_size: int, device: torch.device
    ) -> list[_Group]:
        """Gather indices and masks for the decode group and the prefill group."""
        decodes = [s for s in layout if s.num_query_tokens == 1]
        prefills = [s for s in layout if s.num_query_tokens > 1]
        groups = []
        if decodes:
            groups.append(_group(decodes, block_size, device, self.dtype, self.decode_kernel))
        if prefills:
            groups.append(_group(prefills, block_size, device, self.dtype))
        return groups

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
        for index, group in enumerate(prepared):
            if group.decode_inputs is not None:
                assert self.decode_kernel is not None
                rows: slice | torch.Tensor = group.output_rows
                if group.row_slice is not None:
                    rows = slice(*group.row_slice)
                output[rows] = self.decode_kernel(queries[rows], keys, values, group.decode_inputs)
            elif group.row_slice is not None:
                first, end = group.row_slice
                query = queries[first:end].unsqueeze(2)  # [B, heads, 1, head_dim]
                output[first:end] = self._attend_group(query, keys, values, group, index)[:, :, 0]
            else:
                query = queries[group.query_rows].transpose(1, 2)  # [B, heads, max_q, head_dim]
                attended = self._attend_group(query, keys, values, group, index)
                output[group.output_rows] = attended.transpose(1, 2)[group.valid]
        return output

    def _attend_group(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        group: _Group,
        index: int,
    ) -> torch.Tensor:
        """SDPA of ``query`` [B, heads, max_q, head_dim] over the group's gathered K/V."""
        _, num_kv_heads, head_dim = keys.shape
        gathered = (len(group.query_rows), group.num_kv_slots, num_kv_heads, head_dim)
        key = self._gather(keys, group, (index, 0))
        value = self._gather(values, group, (index, 1))
        key = key.view(gathered).transpose(1, 2)  # [B, kv_heads, kv_slots, head_dim]
        value = value.view(gathered).transpose(1, 2)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=group.additive_mask, enable_gqa=True
        )  # [B, heads, max_q, head_dim]
