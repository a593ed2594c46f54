"""Block sizes for the grouped matmul kernel, keyed by shape.

The key is the average number of rows per group, bucketed: with 128 experts and 8k
routed rows each expert sees ~64 rows, so a 64-row tile wastes little on ragged group
edges while 128-row tiles pay off once groups are large. Entries are starting points
chosen by reasoning, not measured on an H200 yet.
"""

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatmulBlocks:
    block_m: int
    block_k: int
    block_n: int
    num_warps: int
    num_stages: int


# (max average rows per group) -> blocks; the first bucket that fits wins.
_TABLE = (
    (32, MatmulBlocks(block_m=32, block_k=64, block_n=128, num_warps=4, num_stages=4)),
    (96, MatmulBlocks(block_m=64, block_k=64, block_n=128, num_warps=4, num_stages=4)),
    (None, MatmulBlocks(block_m=128, block_k=64, block_n=128, num_warps=8, num_stages=3)),
)


def _fit(block, dim):
    """Largest power of two <= block dividing dim (dims are multiples of 16)."""
    while dim % block:
        block //= 2
    return block


def matmul_blocks(*, num_rows, num_groups, k, n):
    """Tuned blocks for lhs [num_rows, k] times rhs [num_groups, k, n]."""
    rows_per_group = num_rows / max(num_groups, 1)
    for limit, blocks in _TABLE:
        if limit is None or rows_per_group <= limit:
            return dataclasses.replace(blocks, block_k=_fit(blocks.block_k, k),
                                       block_n=_fit(blocks.block_n, n))
    raise AssertionError("unreachable: the last bucket has no limit")
