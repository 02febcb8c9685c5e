"""The physical K/V blocks of one worker: who holds which, and which hold a cached prefix.

The scheduler owns every worker's block tables (a plan grants the blocks), so
this ledger is exact: a block is *free* (content meaningless), *held* by one
or more requests (``refcount``), or *evictable* (held by nobody but keeping
the K/V of a cached prefix block, found by its chain hash). Admission counts
free and evictable blocks alike (``num_free``): an evictable block is evicted
only when a request needs a block and no free one is left.

Eviction: least recently released first, taken from the cache group that
holds the most evictable blocks (one allocation at a time), so a tenant
churning distinct prefixes evicts its own blocks before anyone else's (a
max-min fair share of the cache, to within one request's blocks). A
request's blocks are released tail first, so a chain loses its last blocks
before its first (a prefix is only found from its start).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` K/V slots."""
    return -(-num_tokens // block_size)


@dataclass
class PrefixCacheStats:
    """What the prefix cache did on one worker (the stats the benchmarks read)."""

    num_queries: int = 0  # placements that looked up a prefix
    num_hits: int = 0  # of them, placements that found one block or more
    num_query_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # prompt tokens whose K/V came from the cache
    num_evictions: int = 0  # cached blocks evicted to make room

    def since(self, earlier: PrefixCacheStats) -> dict[str, int]:
        """What changed since ``earlier`` (a copy of these stats), by field."""
        return {
            field.name: getattr(self, field.name) - getattr(earlier, field.name)
            for field in fields(self)
            if getattr(self, field.name) != getattr(earlier, field.name)
        }


class _LargestFirst:
    """Evictable blocks per cache group, LRU within a group, the largest group first.

    The largest group is found through a heap of (-size, group) entries, one
    pushed whenever a group's size changes, once per batch (a release, a
    hit, an allocation); entries whose size is no longer the group's are
    dropped when they reach the top, and the heap is rebuilt when they
    outnumber the groups.
    """

    __slots__ = ("_groups", "_heap", "size")

    def __init__(self) -> None:
        self._groups: dict[str, OrderedDict[int, None]] = {}
        self._heap: list[tuple[int, str]] = []
        self.size = 0

    def push(self, group: str, block_ids: Iterable[int]) -> None:
        """Add blocks as the group's most recently released, in order."""
        blocks = self._groups.setdefault(group, OrderedDict())
        before = len(blocks)
        blocks.update(dict.fromkeys(block_ids))
        self.size += len(blocks) - before
        self._resized(group, blocks)

    def remove(self, group: str, block_ids: Iterable[int]) -> None:
        """Take these blocks of the group out (they are held again)."""
        blocks = self._groups[group]
        before = len(blocks)
        for block_id in block_ids:
            del blocks[block_id]
        self.size -= before - len(blocks)
        self._resized(group, blocks)

    def pop(self, count: int) -> list[int]:
        """``count`` blocks, least recently released first, from the largest
        group (then the next largest, if it has fewer): one allocation at a
        time, not one block, so groups of equal size are not visited in turn
        block by block (the caller knows there are that many)."""
        taken: list[int] = []
        while len(taken) < count:
            group, blocks = self._top()
            assert blocks is not None, "fewer evictable blocks than asked for"
            heapq.heappop(self._heap)
            for _ in range(min(count - len(taken), len(blocks))):
                taken.append(blocks.popitem(last=False)[0])
            self._resized(group, blocks)
        self.size -= count
        return taken

    def _top(self) -> tuple[str, OrderedDict[int, None] | None]:
        """The largest group and its blocks (None when there is none), stale entries dropped."""
        heap, groups = self._heap, self._groups
        while heap:
            negative_size, group = heap[0]
            blocks = groups.get(group)
            if blocks is not None and len(blocks) == -negative_size:
                return group, blocks
            heapq.heappop(heap)
        return "", None

    def _resized(self, group: str, blocks: OrderedDict[int, None]) -> None:
        if not blocks:
            del self._groups[group]
            return
        heapq.heappush(self._heap, (-len(blocks), group))
        if len(self._heap) > 4 * len(self._groups) + 64:
            self._heap = [(-len(blocks), name) for name, blocks in self._groups.items()]
            heapq.heapify(self._heap)


class BlockLedger:
    """Every block of one worker: free, held (by refcount) or evictable (cached, unheld)."""

    __slots__ = (
        "_block_of",
        "_cached",
        "_evictable",
        "_free",
        "_refcounts",
        "block_size",
        "num_blocks",
        "num_used",
        "prefix_caching",
        "stats",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = True,
        stats: PrefixCacheStats | None = None,
    ) -> None:
        """``stats``: where to count what the cache does (shared by all workers'
        ledgers, so the totals survive a worker that joins again)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.num_used = 0  # blocks held by at least one request
        self.stats = PrefixCacheStats() if stats is None else stats
        self._free: deque[int] = deque(range(num_blocks))
        self._refcounts = [0] * num_blocks
        # A cached block's chain hash and cache group, and the block of each hash.
        self._cached: dict[int, tuple[bytes, str]] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable = _LargestFirst()

    @property
    def num_free(self) -> int:
        """Blocks a request can be given: free ones and evictable cached ones."""
        return self.num_blocks - self.num_used

    @property
    def num_free_tokens(self) -> int:
        """K/V slots in those blocks (comparable across block sizes)."""
        return self.num_free * self.block_size

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix block, held or not."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request holds."""
        return self._evictable.size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks this worker needs for ``num_tokens`` slots."""
        return -(-num_tokens // self.block_size)

    def can_hold(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` slots fit the whole cache (ignoring other requests)."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more blocks can be given (evicting if need be)."""
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks: free ones first, then evicted ones; the
        caller checked ``can_allocate``."""
        assert 0 <= num_blocks <= self.num_free, (num_blocks, self.num_free)
        free = self._free
        block_ids = [free.popleft() for _ in range(min(num_blocks, len(free)))]
        if len(block_ids) < num_blocks:
            evicted = self._evictable.pop(num_blocks - len(block_ids))
            for block_id in evicted:
                hash_, _ = self._cached.pop(block_id)
                del self._block_of[hash_]
            self.stats.num_evictions += len(evicted)
            block_ids += evicted
        refcounts = self._refcounts
        for block_id in block_ids:
            refcounts[block_id] = 1
        self.num_used += num_blocks
        return block_ids

    def release(self, block_ids: Sequence[int]) -> None:
        """A request lets go of its blocks (its table, in token order): a block
        nobody holds any more is free, or evictable if it is cached."""
        refcounts, cached_blocks = self._refcounts, self._cached
        evictable: dict[str, list[int]] = {}
        for block_id in reversed(block_ids):  # the chain's tail is evicted first
            refcount = refcounts[block_id] - 1
            assert refcount >= 0, block_id
            refcounts[block_id] = refcount
            if refcount:
                continue
            self.num_used -= 1
            cached = cached_blocks.get(block_id)
            if cached is None:
                self._free.append(block_id)
            else:
                evictable.setdefault(cached[1], []).append(block_id)
        for group, group_blocks in evictable.items():
            self._evictable.push(group, group_blocks)

    def match(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks caching the longest prefix of a chain of block hashes."""
        block_of = self._block_of
        block_ids = []
        for hash_ in hashes:
            block_id = block_of.get(hash_)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_revived(self, block_ids: Iterable[int]) -> int:
        """How many of these cached blocks nobody holds: taking them uses up free capacity."""
        refcounts = self._refcounts
        return sum(1 for block_id in block_ids if not refcounts[block_id])

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Hold cached blocks (a prefix hit); an evictable one is revived."""
        refcounts = self._refcounts
        revived: dict[str, list[int]] = {}
        for block_id in block_ids:
            if not refcounts[block_id]:
                revived.setdefault(self._cached[block_id][1], []).append(block_id)
                self.num_used += 1
            refcounts[block_id] += 1
        for group, group_blocks in revived.items():
            self._evictable.remove(group, group_blocks)

    def commit(self, block_id: int, hash_: bytes, group: str) -> None:
        """A held block is full and its K/V written: cache it under its chain
        hash. A block already cached, or a hash another block caches already
        (the same prefix computed twice), stays as it is."""
        assert self._refcounts[block_id] > 0, block_id
        if self.prefix_caching and block_id not in self._cached and hash_ not in self._block_of:
            self._cached[block_id] = (hash_, group)
            self._block_of[hash_] = block_id
