"""Block sizes for the grouped matmul kernel, per case, keyed by average rows per group.

Work: every row tile of a group is one program per column block, and a tile straddling a
group boundary is multiplied once per group it touches, so the MMA work is about
(1 + block_m / rows per group) times the real rows'. Weights: each program streams its
group's [K, block_n] column block once; consecutive items of one group share it in L2.

- decode (<= 8 rows per group: up to 64 tokens x top-8 over 128 experts). Bound by
  reading the touched experts' weights, not by MMA: the smallest `tl.dot` tile
  (block_m 16) and narrow column blocks (block_n 64) so the touched experts fill the
  machine. At batch 1, 8 experts x 1536 / 64 = 192 gate/up programs (96 with 128-wide
  blocks on 132 SMs), each streaming 16 KB weight blocks with 4 stages in flight.
- small batches (<= 48 rows per group): block_m 32 keeps the straddle waste <= 2x where
  a group holds a few dozen rows; still bandwidth bound.
- prefill (<= 192 rows per group: a 2k-token chunk gives 128): block_m 64, the smallest
  tile Triton issues as one Hopper wgmma per warpgroup; waste 1 + 64/128 = 1.5x, where
  block_m 128 would double the work (the first cut of this table did).
- long prefill (> 192 rows per group): block_m 128 with 8 warps; waste <= 1.67x and
  falling (1.25x at 512 rows per group).

Chosen by this reasoning, not yet measured on an H200 (benchmarks/device_probe.py
measures them).
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
    (8, MatmulBlocks(block_m=16, block_k=128, block_n=64, num_warps=4, num_stages=4)),
    (48, MatmulBlocks(block_m=32, block_k=64, block_n=128, num_warps=4, num_stages=4)),
    (192, MatmulBlocks(block_m=64, block_k=64, block_n=128, num_warps=4, num_stages=3)),
    (None, MatmulBlocks(block_m=128, block_k=64, block_n=128, num_warps=8, num_stages=3)),
)


def _fit(block, dim):
    """Largest power of two <= block dividing dim (dims are multiples of 16)."""
    while dim % block:
        block //= 2
    return block


def block_m_for(*, num_rows, num_groups) -> int:
    """The row tile for this case; every call sharing one plan must use it."""
    return matmul_blocks(num_rows=num_rows, num_groups=num_groups, k=16, n=16).block_m


def matmul_blocks(*, num_rows, num_groups, k, n):
    """Tuned blocks for lhs [num_rows, k] times rhs [num_groups, k, n]."""
    rows_per_group = num_rows / max(num_groups, 1)
    for limit, blocks in _TABLE:
        if limit is None or rows_per_group <= limit:
            return dataclasses.replace(blocks, block_k=_fit(blocks.block_k, k),
                                       block_n=_fit(blocks.block_n, n))
    raise AssertionError("unreachable: the last bucket has no limit")
