"""The block table of each request an engine runs: the physical K/V blocks the
scheduler granted it, in token order.

Pure bookkeeping (no torch). The scheduler picks every block (a plan's
``block_grants``): two requests may share a block that caches a prompt
prefix, and a table is only forgotten here, never freed, since which blocks
are free is the scheduler's to know. ``ceil(tokens / block_size)`` blocks
hold ``tokens`` slots, the rule both sides use.
"""

from __future__ import annotations

from collections.abc import Iterable


class UnknownRequestError(KeyError):
    """A request id that has no block table here."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` K/V slots."""
    return -(-num_tokens // block_size)


class BlockTables:
    """Request id -> block ids in ``[0, num_blocks)``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need positive num_blocks and block_size, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def table(self, request_id: str) -> list[int]:
        """The blocks holding ``request_id``'s K/V, in token order."""
        try:
            return self._tables[request_id]
        except KeyError:
            raise UnknownRequestError(request_id) from None

    def num_held(self, request_id: str) -> int:
        """Blocks in ``request_id``'s table (0 without one)."""
        table = self._tables.get(request_id)
        return 0 if table is None else len(table)

    def extend(self, request_id: str, block_ids: Iterable[int]) -> None:
        """Append granted blocks to ``request_id``'s table (made if it has none)."""
        self._tables.setdefault(request_id, []).extend(block_ids)

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s table; a no-op if it has none."""
        self._tables.pop(request_id, None)

    def num_referenced(self) -> int:
        """Distinct blocks in some table (a shared block counts once)."""
        return len({block_id for table in self._tables.values() for block_id in table})

    def unreferenced(self, ignoring: Iterable[str] = ()) -> list[int]:
        """Blocks in no table (the tables of ``ignoring`` left out), in order."""
        ignored = set(ignoring)
        referenced = {
            block_id
            for request_id, table in self._tables.items()
            if request_id not in ignored
            for block_id in table
        }
        return [block_id for block_id in range(self.num_blocks) if block_id not in referenced]
