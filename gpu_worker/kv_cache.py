"""The paged K/V pool: one preallocated tensor pair per layer, and how many
blocks it gets (``size_kv_cache``: the rule is in docs/architecture.md, *K/V pool size*)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from enum import StrEnum

import torch

from gpu_worker.block_tables import BlockTables, blocks_for
from gpu_worker.model_config import ModelConfig
from shared.settings import (
    DEFAULT_KV_CACHE_MAX_SEQUENCES,
    check_kv_cache_fraction,
    default_kv_cache_fraction,
)

DEFAULT_BLOCK_SIZE = 16
# A pool sized from memory keeps this many significant bits of its block count
# (``stable_block_count``).
STABLE_SIGNIFICANT_BITS = 4


class KVCacheSizeError(ValueError):
    """The pool cannot be sized as configured: a setting to change, told at start."""


@dataclass(frozen=True)
class KVCacheBudget:
    """How much memory the pool may take: ``num_bytes`` exactly; else ``fraction``
    (None: the device's default) of the memory available once the model is
    loaded, but no more than ``max_sequences`` sequences of the model's full
    context can use."""

    num_bytes: int | None = None
    fraction: float | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_sequences: int = DEFAULT_KV_CACHE_MAX_SEQUENCES

    def __post_init__(self) -> None:
        if self.num_bytes is not None and self.num_bytes < 1:
            raise KVCacheSizeError(f"--kv-cache-bytes must be >= 1, got {self.num_bytes}")
        if self.fraction is not None:
            try:
                check_kv_cache_fraction(self.fraction)
            except ValueError as error:
                raise KVCacheSizeError(f"--kv-cache-fraction {error}") from None
        if self.block_size < 1:
            raise KVCacheSizeError(f"--block-size must be >= 1, got {self.block_size}")
        if self.max_sequences < 1:
            raise KVCacheSizeError(
                f"--kv-cache-max-sequences must be >= 1, got {self.max_sequences}"
            )


class KVCacheLimit(StrEnum):
    """What set the pool's size."""

    KV_CACHE_BYTES = "kv_cache_bytes"  # the size asked for
    MEMORY = "memory"  # the fraction of the available memory
    MAX_SEQUENCES = "max_sequences"  # max_sequences full-context sequences


@dataclass(frozen=True)
class KVCacheSize:
    """The pool's size and why: what ``size_kv_cache`` decided, for the log."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    limited_by: KVCacheLimit
    available_bytes: int
    fraction: float
    max_sequences: int
    max_context_tokens: int

    @property
    def num_bytes(self) -> int:
        """Bytes of the whole pool (K and V of every layer)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one sequence of the model's full context takes."""
        return blocks_for(self.max_context_tokens, self.block_size)

    @property
    def num_full_sequences(self) -> int:
        """Sequences of the model's full context the pool holds at once."""
        return self.num_blocks // self.blocks_per_sequence

    def log_fields(self) -> dict[str, object]:
        """The fields of the worker's ``kv_cache_sized`` line."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_bytes": self.num_bytes,
            "bytes_per_block": self.bytes_per_block,
            "limited_by": str(self.limited_by),
            "available_bytes": self.available_bytes,
            "fraction": self.fraction,
            "max_sequences": self.max_sequences,
            "max_context_tokens": self.max_context_tokens,
            "num_full_sequences": self.num_full_sequences,
            "max_sequence_tokens": min(self.num_blocks * self.block_size, self.max_context_tokens),
        }


def size_kv_cache(
    budget: KVCacheBudget,
    *,
    bytes_per_block: int,
    max_context_tokens: int,
    available_bytes: int,
    default_fraction: float,
) -> KVCacheSize:
    """The pool's blocks under ``budget`` (pure: the memory reading is passed in).

    ``budget.num_bytes``, when set, wins (it must fit in ``available_bytes``).
    Otherwise the pool takes ``fraction`` of ``available_bytes``, but never more
    blocks than ``max_sequences`` sequences of ``max_context_tokens`` use
    (the scheduler places at most that many requests on a worker, none past the
    model's context), and it must hold one such sequence: a request the
    gateway accepts must fit. Raises KVCacheSizeError with what was needed, what
    was available and which flag to change.
    """
    assert bytes_per_block > 0 and max_context_tokens > 0 and available_bytes >= 0
    fraction = default_fraction if budget.fraction is None else budget.fraction
    block_size = budget.block_size
    blocks_per_sequence = blocks_for(max_context_tokens, block_size)
    cap_blocks = budget.max_sequences * blocks_per_sequence
    sequence_bytes = blocks_per_sequence * bytes_per_block

    def sized(num_blocks: int, limited_by: KVCacheLimit) -> KVCacheSize:
        return KVCacheSize(
            num_blocks, block_size, bytes_per_block, limited_by, available_bytes,
            fraction, budget.max_sequences, max_context_tokens,
        )  # fmt: skip

    if budget.num_bytes is not None:
        if budget.num_bytes > available_bytes:
            raise KVCacheSizeError(
                f"--kv-cache-bytes asks for {format_bytes(budget.num_bytes)} of K/V, but only "
                f"{format_bytes(available_bytes)} is available with the model loaded; "
                "lower --kv-cache-bytes (or leave it out to size the pool from memory)"
            )
        num_blocks = budget.num_bytes // bytes_per_block
        if num_blocks < 1:
            raise KVCacheSizeError(
                f"--kv-cache-bytes {budget.num_bytes} holds not even one block "
                f"({bytes_per_block} bytes: {block_size} tokens of K and V in every layer)"
            )
        # Below one full-context sequence is allowed here (the scheduler refuses
        # what no worker can hold): a small pool asked for serves shorter requests.
        return sized(num_blocks, KVCacheLimit.KV_CACHE_BYTES)
    memory_blocks = int(fraction * available_bytes) // bytes_per_block
    if memory_blocks < blocks_per_sequence:
        # The smallest fraction (in hundredths) that would hold one; none may reach 1.
        enough = math.ceil(sequence_bytes * 100 / available_bytes) / 100 if available_bytes else 1
        remedy = "free memory, "
        if enough < 1:
            remedy = f"raise --kv-cache-fraction to {enough:.2f} or more, "
        raise KVCacheSizeError(
            f"the K/V pool cannot hold one sequence of the model's context: "
            f"{max_context_tokens} tokens need {format_bytes(sequence_bytes)} "
            f"({blocks_per_sequence} blocks of {format_bytes(bytes_per_block)}), but "
            f"--kv-cache-fraction {fraction:g} of the {format_bytes(available_bytes)} available "
            f"with the model loaded is {format_bytes(int(fraction * available_bytes))}; "
            f"{remedy}or set --kv-cache-bytes (a pool below one full context serves only "
            "shorter requests)"
        )
    if memory_blocks <= cap_blocks:
        return sized(
            max(blocks_per_sequence, stable_block_count(memory_blocks)), KVCacheLimit.MEMORY
        )
    return sized(cap_blocks, KVCacheLimit.MAX_SEQUENCES)


def stable_block_count(num_blocks: int) -> int:
    """``num_blocks`` rounded down to its 4 most significant bits (3,098 and 3,095
    both give 3,072; at most an eighth less). The free memory a pool is sized
    from moves a little from one start to the next, and the pool's size is a
    constant of the compiled decode graphs: a pool of another size missed
    inductor's cache and compiled every graph again (21 s against 3 s for
    SmolLM2's lone graph; a size dynamic in the graphs broke their shape
    reasoning on the pool's blocks view)."""
    drop_bits = max(0, num_blocks.bit_length() - STABLE_SIGNIFICANT_BITS)
    return (num_blocks >> drop_bits) << drop_bits


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` for a reader: 737280 -> '720.0 KiB'."""
    if num_bytes < 1024:
        return f"{num_bytes} bytes"
    value = num_bytes / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of ``block_size`` tokens in every layer."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


def available_memory_bytes(device: torch.device) -> int:
    """Memory the pool could take now: free memory on a CUDA device (what
    torch's allocator caches but does not use counted free), else the host's
    MemAvailable."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_cache_size(
    config: ModelConfig, budget: KVCacheBudget, device: torch.device, dtype: torch.dtype
) -> KVCacheSize:
    """``size_kv_cache`` for this model on ``device``, with the memory available now
    (call it once the model is loaded: what the model takes is then not available)."""
    return size_kv_cache(
        budget,
        bytes_per_block=bytes_per_block(config, budget.block_size, dtype),
        max_context_tokens=config.max_position_embeddings,
        available_bytes=available_memory_bytes(device),
        default_fraction=default_kv_cache_fraction(device.type),
    )


class PagedKVCache:
    """K/V for every layer in ``num_blocks * block_size`` slots, plus the block tables.

    Slot ``block * block_size + offset`` holds the token at ``offset`` within a
    request's block. The scheduler decides who holds which block.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.tables = BlockTables(num_blocks, block_size)
        self.block_size = block_size
        num_slots = num_blocks * block_size
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        # A tensor per layer, not views of one: a compiled graph that writes a
        # view of one tensor rewrites all of it (compiled_decode.py).
        layers = range(config.num_layers)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.tables.num_blocks

    def with_own_tables(self) -> PagedKVCache:
        """The same pool (the same tensors) with block tables of its own: for work on
        another thread (the start-up's path checks) in blocks no served request holds,
        whose tables the serving thread never sees change."""
        twin = copy.copy(self)
        twin.tables = BlockTables(self.num_blocks, self.block_size)
        return twin

    def slot_ids(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of ``request_id``'s tokens at positions ``[start, end)``."""
        table = self.tables.table(request_id)
        size = self.block_size
        return [table[position // size] * size + position % size for position in range(start, end)]
