"""Block sizes for the stacked (layer-indexed) dense matmul, per case.

- decode (<= 64 rows): bound by reading the weights (a q/k/v projection of Qwen3-30B-A3B
  is 20 MB per layer, its rows 8-64 tokens). One 16-row tile (the smallest `tl.dot`
  tile) and column blocks narrow enough that the weight's columns give >= ~128 programs
  (one per SM of an H200 and more), with 128-deep K steps and 4 stages of loads in flight.
- prefill: compute bound; 128 x 128 x 64 tiles with 8 warps, the shape of Triton's
  sm90 matmul tutorial configs. Programs walk the rows of one column block in a row, so
  a weight block is read from HBM once and from L2 after.
- in between (<= 256 rows): 64-row tiles, 128-wide columns.

Chosen by this reasoning, not yet measured on an H200.
"""

from pallas_kernels.grouped_matmul.tuning import MatmulBlocks  # the same tile record

_DECODE_ROWS = 64
_TARGET_PROGRAMS = 128


def _fit(block, dim):
    """Tiles need not divide the dims (edges are masked); only avoid tiles larger than
    the dim's next power of two."""
    return max(16, min(block, 1 << (dim - 1).bit_length()))


def matmul_blocks(*, num_rows, k, widths) -> MatmulBlocks:
    """Tuned blocks for x [num_rows, k] times weights [k, N_i] (columns concatenated)."""
    width = max(widths)
    if num_rows <= _DECODE_ROWS:
        block_n = 1 << max(4, (sum(widths) // _TARGET_PROGRAMS).bit_length() - 1)
        return MatmulBlocks(block_m=16, block_k=_fit(128, k), block_n=_fit(min(128, block_n),
                                                                          width),
                            num_warps=4, num_stages=4)
    if num_rows <= 256:
        return MatmulBlocks(block_m=64, block_k=_fit(64, k), block_n=_fit(128, width),
                            num_warps=4, num_stages=3)
    return MatmulBlocks(block_m=128, block_k=_fit(64, k), block_n=_fit(128, width),
                        num_warps=8, num_stages=3)
