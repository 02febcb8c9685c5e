"""Paged K/V bookkeeping: which fixed-size blocks each request holds.

Pure bookkeeping (no torch): a free list of block numbers and one block table
per request. ``ceil(tokens / block_size)`` blocks hold ``tokens`` slots, the
same rule the scheduler uses to know what fits.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(Exception):
    """A request needed more K/V blocks than the pool has free."""


class UnknownRequestError(KeyError):
    """A request id that holds no blocks here."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` K/V slots."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Hands out block numbers in ``[0, num_blocks)`` to requests."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need positive num_blocks and block_size, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request."""
        return len(self._free_blocks)

    def block_table(self, request_id: str) -> list[int]:
        """The blocks holding ``request_id``'s K/V, in token order."""
        try:
            return self._block_tables[request_id]
        except KeyError:
            raise UnknownRequestError(request_id) from None

    def holds(self, request_id: str) -> bool:
        """True when ``request_id`` has a block table here."""
        return request_id in self._block_tables

    def blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``num_tokens`` slots in all."""
        held = len(self._block_tables.get(request_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - held)

    def can_grow(self, growth: dict[str, int]) -> bool:
        """True when every request in ``growth`` (id -> total tokens) fits at once."""
        needed = sum(self.blocks_to_grow(request_id, n) for request_id, n in growth.items())
        return needed <= len(self._free_blocks)

    def grow(self, growth: dict[str, int]) -> None:
        """Give each request enough blocks for its total tokens; all or nothing."""
        needed = {
            request_id: self.blocks_to_grow(request_id, n) for request_id, n in growth.items()
        }
        total = sum(needed.values())
        if total > len(self._free_blocks):
            raise OutOfBlocksError(
                f"step needs {total} more K/V blocks but only {len(self._free_blocks)} of "
                f"{self.num_blocks} are free"
            )
        for request_id, count in needed.items():
            table = self._block_tables.setdefault(request_id, [])
            table.extend(self._free_blocks.popleft() for _ in range(count))

    def free(self, request_id: str) -> int:
        """Return ``request_id``'s blocks to the pool; how many. No-op if it holds none."""
        table = self._block_tables.pop(request_id, [])
        self._free_blocks.extend(table)
        return len(table)
