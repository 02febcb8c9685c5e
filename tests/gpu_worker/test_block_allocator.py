import pytest

from gpu_worker.block_allocator import (
    BlockAllocator,
    OutOfBlocksError,
    UnknownRequestError,
    blocks_for,
)


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_grow_allocates_on_demand_and_free_returns_everything():
    allocator = BlockAllocator(num_blocks=10, block_size=4)
    allocator.grow({"a": 5, "b": 1})
    assert len(allocator.block_table("a")) == 2
    assert len(allocator.block_table("b")) == 1
    allocator.grow({"a": 8})  # still two blocks
    assert len(allocator.block_table("a")) == 2
    allocator.grow({"a": 9})
    assert len(allocator.block_table("a")) == 3
    assert allocator.num_free_blocks == 6
    assert set(allocator.block_table("a")).isdisjoint(allocator.block_table("b"))
    assert allocator.free("a") == 3
    assert allocator.free("a") == 0  # idempotent
    allocator.free("b")
    assert allocator.num_free_blocks == 10


def test_running_out_is_an_error_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    allocator.grow({"a": 4})
    assert not allocator.can_grow({"a": 8, "b": 8})
    with pytest.raises(OutOfBlocksError, match="needs 3 more K/V blocks but only 2"):
        allocator.grow({"a": 8, "b": 8})
    assert allocator.num_free_blocks == 2
    assert not allocator.holds("b")
    assert allocator.can_grow({"a": 12})


def test_unknown_request_has_no_table():
    with pytest.raises(UnknownRequestError):
        BlockAllocator(2, 4).block_table("nobody")
