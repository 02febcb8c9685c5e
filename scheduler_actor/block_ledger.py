"""Block accounting of one worker's paged K/V cache.

The worker owns the block tables; the scheduler mirrors only block counts with
the same rule, ``ceil(tokens / block_size)``, so it knows exactly what fits.
"""

from __future__ import annotations


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` K/V slots."""
    return -(-num_tokens // block_size)


class BlockLedger:
    """Counts the K/V blocks of one worker that the scheduler has handed out."""

    __slots__ = ("block_size", "num_blocks", "num_used")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_used = 0

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return self.num_blocks - self.num_used

    @property
    def num_free_tokens(self) -> int:
        """K/V slots in free blocks (comparable across block sizes)."""
        return self.num_free * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks this worker needs for ``num_tokens`` slots."""
        return -(-num_tokens // self.block_size)

    def can_hold(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` slots fit the whole cache (ignoring other requests)."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more blocks are free."""
        return self.num_used + num_blocks <= self.num_blocks

    def allocate(self, num_blocks: int) -> None:
        """Hand out ``num_blocks``; the caller checked ``can_allocate``."""
        assert num_blocks >= 0 and self.can_allocate(num_blocks), (num_blocks, self.num_free)
        self.num_used += num_blocks

    def free(self, num_blocks: int) -> None:
        """Take back ``num_blocks`` a request held."""
        assert 0 <= num_blocks <= self.num_used, (num_blocks, self.num_used)
        self.num_used -= num_blocks
