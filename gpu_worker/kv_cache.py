"""The paged K/V pool: one preallocated tensor pair per layer, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.block_tables import BlockTables
from gpu_worker.model_config import ModelConfig

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVCacheBudget:
    """How much memory the pool may take: ``num_bytes``, else ``fraction`` of what is free."""

    num_bytes: int | None = None
    fraction: float = 0.25
    block_size: int = DEFAULT_BLOCK_SIZE


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of ``block_size`` tokens in every layer."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


def free_memory_bytes(device: torch.device) -> int:
    """Memory the pool could take now: free GPU memory, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def num_blocks_for_budget(
    config: ModelConfig, budget: KVCacheBudget, device: torch.device, dtype: torch.dtype
) -> int:
    """How many blocks the budget buys (at least one)."""
    budget_bytes = budget.num_bytes
    if budget_bytes is None:
        if not 0 < budget.fraction <= 1:
            raise ValueError(f"K/V memory fraction must be in (0, 1], got {budget.fraction}")
        budget_bytes = int(free_memory_bytes(device) * budget.fraction)
    num_blocks = budget_bytes // bytes_per_block(config, budget.block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"K/V budget of {budget_bytes} bytes holds not even one block")
    return int(num_blocks)


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

    def slot_ids(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of ``request_id``'s tokens at positions ``[start, end)``."""
        table = self.tables.table(request_id)
        size = self.block_size
        return [table[position // size] * size + position % size for position in range(start, end)]
