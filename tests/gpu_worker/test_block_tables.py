"""The engine's block tables: granted blocks in token order, forgotten, never freed."""

import pytest

from gpu_worker.block_tables import BlockTables, UnknownRequestError, blocks_for


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_tables_extend_share_and_forget() -> None:
    tables = BlockTables(num_blocks=10, block_size=4)
    tables.extend("a", [3, 1])
    tables.extend("b", [3, 7])  # block 3 shared: a cached prefix
    tables.extend("a", [9])
    assert tables.table("a") == [3, 1, 9] and tables.num_held("b") == 2
    assert tables.num_referenced() == 4
    assert tables.unreferenced(ignoring=["b"]) == [0, 2, 4, 5, 6, 7, 8]
    tables.forget("a")
    tables.forget("a")  # idempotent
    assert tables.num_held("a") == 0 and tables.num_referenced() == 2
    with pytest.raises(UnknownRequestError):
        tables.table("a")


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_tables_need_positive_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockTables(num_blocks, block_size)
