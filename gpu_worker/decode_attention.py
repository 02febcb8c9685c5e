"""Decode attention on the CPU that reads the paged pool where it lies.

A decoding request has one new query; it attends over every slot of its
blocks up to its position. ``paged_decode_attention`` writes that as
products, sums and a softmax over the blocks gathered by id, which inductor
(torch.compile's C++ backend) fuses into a few loops that read each block of
the pool in place: no copy of the blocks, no SDPA call per head. The lone
decode's graph traces it (``compiled_decode.py``); ``CompiledDecodeAttention``
compiles it alone for the decodes of every other step, whose K/V the eager
path copied out of the pool layer by layer before SDPA read them again (at
64 requests of 256 tokens, the copies alone were 75 ms of a 400 ms step:
docs/history/benchmarks-notebook.md, *batched decodes read the K/V pool in
place*).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from gpu_worker.attention import SequenceLayout
from gpu_worker.block_tables import blocks_for
from gpu_worker.unguarded_compile import UnguardedGraph, max_relative_error

# torch specializes dimensions of size 0 and 1: block ids are padded (with a
# masked block) to at least this many per request, and a compiled call takes
# at least this many requests.
MIN_BLOCKS = 2
MIN_REQUESTS = 2
# The largest decode batch one compiled call takes (a bound dynamo's shape
# reasoning needs; far above any scheduler's batch).
MAX_REQUESTS = 1 << 16
MAX_POOL_BLOCKS = 1 << 36
# How far the compiled attention may stray from the eager one at start,
# relative to the largest output (fused loops round differently).
MAX_ATTENTION_ERROR = 1e-4

_log = structlog.get_logger(__name__)


def paged_decode_attention(
    queries: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_ids: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Each request's one query over its blocks' slots up to its position.

    queries [requests, heads, head_dim]; key_blocks, value_blocks: one layer's
    pool by block, [pool blocks, block_size, kv_heads, head_dim] (``pool_blocks``);
    block_ids [requests, blocks] (padding with any block past the position: it
    is masked); positions [requests], the new token's (its K/V already written)
    -> [requests, heads, head_dim].
    """
    _, block_size, num_kv_heads, head_dim = key_blocks.shape
    num_requests, num_heads, _ = queries.shape
    num_blocks = block_ids.shape[1]
    # [requests, kv_heads, 1, blocks, block_size, head_dim]: each kv head's slots, by
    # block; its query heads broadcast beside. Every sum below runs over at most the
    # blocks or a block's slots: inductor guards fp32 sums of more than 4,096 values
    # (its chunked accumulation), which would cap a graph's context.
    key = key_blocks[block_ids].permute(0, 3, 1, 2, 4)[:, :, None]
    value = value_blocks[block_ids].permute(0, 3, 1, 2, 4)[:, :, None]
    grouped = queries.view(num_requests, num_kv_heads, num_heads // num_kv_heads, 1, 1, head_dim)
    scores = (grouped * head_dim**-0.5 * key).sum(-1)  # [requests, kv_heads, group, blocks, slots]
    slots = torch.arange(num_blocks * block_size, device=queries.device)
    past = slots.view(num_blocks, block_size) > positions.view(num_requests, 1, 1, 1, 1)
    scores = scores.masked_fill(past, float("-inf"))
    exponents = (scores - scores.amax((-2, -1), keepdim=True)).exp()
    total = exponents.sum(-1).sum(-1)  # [requests, kv_heads, group]
    weighted = (exponents[..., None] * value).sum(-2).sum(-2)  # [requests, kv_heads, group, dim]
    return (weighted / total[..., None]).reshape(num_requests, num_heads, head_dim)


@dataclass(frozen=True)
class DecodeInputs:
    """What ``paged_decode_attention`` needs of a step's decodes besides the queries
    and the pool: tensors only, so nothing of the step is baked into a graph."""

    block_ids: torch.Tensor  # [requests, max(blocks, MIN_BLOCKS)] int64
    positions: torch.Tensor  # [requests] int64: each new token's; slots past it are masked


def decode_inputs(decodes: list[SequenceLayout], device: torch.device) -> DecodeInputs:
    """The block tables of ``decodes`` (one new token each) padded to the longest and to
    at least MIN_BLOCKS with each request's own last block (past its position, so
    masked, and already in the cache lines the request reads), and their positions."""
    width = max(MIN_BLOCKS, *(len(sequence.block_table) for sequence in decodes))
    rows = [s.block_table + [s.block_table[-1]] * (width - len(s.block_table)) for s in decodes]
    positions = [sequence.num_cached_tokens for sequence in decodes]
    return DecodeInputs(
        block_ids=torch.tensor(rows, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
    )


def pool_blocks(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """One layer's keys or values [slots, kv_heads, head_dim] as
    [slots / block_size, block_size, kv_heads, head_dim] (a view)."""
    num_slots, num_kv_heads, head_dim = pool.shape
    return pool.view(num_slots // block_size, block_size, num_kv_heads, head_dim)


class DecodeAttentionCompileError(RuntimeError):
    """The decode attention cannot be compiled here, or its result strays."""


class CompiledDecodeAttention:
    """``paged_decode_attention`` compiled once for one model's heads and dtype and
    any number of requests (at least ``MIN_REQUESTS``), blocks per request (at least
    ``MIN_BLOCKS``) and pool size: those are the graph's dynamic sizes. It runs
    without dynamo's guards; ``UnguardedGraph`` checks every call's inputs against
    what it was compiled for (``unguarded_compile.py``), and ``takes`` says which
    numbers of requests and blocks it was compiled for."""

    def __init__(
        self,
        num_kv_heads: int,
        num_heads: int,
        head_dim: int,
        block_size: int,
        max_blocks: int,
        dtype: torch.dtype,
    ) -> None:
        """Compiles and checks on a warm-up call (DecodeAttentionCompileError if it
        fails, or strays from the uncompiled function)."""
        self.head_shape = (num_heads, head_dim)
        self.kv_shape = (num_kv_heads, head_dim)
        self.block_size = block_size
        self.max_blocks = max(max_blocks, MIN_BLOCKS + 1)
        self.dtype = dtype
        requests = (MIN_REQUESTS, MAX_REQUESTS)
        pool = {0: (MIN_BLOCKS, MAX_POOL_BLOCKS)}
        self._compiled = UnguardedGraph(
            paged_decode_attention,
            dynamic={
                0: {0: requests},  # queries
                1: pool,  # key blocks
                2: pool,  # value blocks
                3: {0: requests, 1: (MIN_BLOCKS, self.max_blocks)},  # block ids
                4: {0: requests},  # positions
            },
        )
        self.compile_s = self._warm_up()

    def takes(self, num_requests: int, num_blocks: int) -> bool:
        """Whether this many requests of this many blocks each (padded, ``decode_inputs``)
        are sizes the graph was compiled for."""
        return (
            MIN_REQUESTS <= num_requests <= MAX_REQUESTS
            and MIN_BLOCKS <= num_blocks <= self.max_blocks
        )

    def __call__(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        inputs: DecodeInputs,
    ) -> torch.Tensor:
        """As ``paged_decode_attention``, on one layer's pool ``keys``, ``values``
        [slots, kv_heads, head_dim], for sizes it ``takes``. ``queries`` may be a
        strided view (the rotary split's): the graph gets a contiguous copy."""
        key_blocks = pool_blocks(keys, self.block_size)
        value_blocks = pool_blocks(values, self.block_size)
        with torch.no_grad():
            return self._compiled(
                queries.contiguous(), key_blocks, value_blocks, inputs.block_ids, inputs.positions
            )

    def _warm_up(self) -> float:
        """Compile on a random pool (three requests, shuffled blocks, positions at
        both ends of a block) with the dynamic sizes marked, then check against the
        uncompiled function."""
        generator = torch.Generator().manual_seed(0)
        num_requests, num_blocks, block_size = 3, 3, self.block_size
        pool_shape = (4 * num_blocks, block_size, *self.kv_shape)
        key_blocks = torch.randn(pool_shape, generator=generator).to(self.dtype)
        value_blocks = torch.randn(pool_shape, generator=generator).to(self.dtype)
        queries = torch.randn(num_requests, *self.head_shape, generator=generator).to(self.dtype)
        block_ids = torch.randperm(4 * num_blocks, generator=generator)[: num_requests * num_blocks]
        block_ids = block_ids.view(num_requests, num_blocks)
        positions = torch.tensor([0, block_size, num_blocks * block_size - 1])
        inputs = (queries, key_blocks, value_blocks, block_ids, positions)
        started = time.perf_counter()
        try:
            with torch.no_grad():
                compiled = self._compiled(*inputs)
        except Exception as error:  # inductor's failures have no common type
            raise DecodeAttentionCompileError(f"{type(error).__name__}: {error}") from error
        compile_s = time.perf_counter() - started
        eager = paged_decode_attention(*inputs)
        deviation = max_relative_error(compiled, eager)
        if not deviation <= MAX_ATTENTION_ERROR:  # NaN too
            raise DecodeAttentionCompileError(
                f"compiled attention strays {deviation:.2g} from the eager one"
            )
        _log.info("decode_attention_compiled", compile_s=round(compile_s, 1), error=deviation)
        return compile_s


def compiled_decode_attention_or_none(
    num_kv_heads: int,
    num_heads: int,
    head_dim: int,
    max_position: int,
    block_size: int,
    dtype: torch.dtype,
) -> CompiledDecodeAttention | None:
    """The compiled decode attention for these shapes, or None with a
    ``decode_attention_not_compiled`` line saying why (the CPU backend then
    copies the blocks out and calls SDPA, as before)."""
    try:
        return CompiledDecodeAttention(
            num_kv_heads, num_heads, head_dim, block_size, blocks_for(max_position, block_size),
            dtype,
        )  # fmt: skip
    except DecodeAttentionCompileError as error:
        _log.warning(
            "decode_attention_not_compiled", reason=str(error), using="SDPA over copied blocks"
        )
        return None
