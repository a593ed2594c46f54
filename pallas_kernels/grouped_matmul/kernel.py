"""Grouped matmul (ragged_dot semantics) as a Triton-backed Pallas kernel.

Rows are cut into `block_m` tiles; a tile that straddles a group boundary is visited
once per group it touches (planned in XLA before the call, see `_plan_items`), each
visit multiplying by that group's weights and storing only its own rows. A trailing
padding segment writes zeros past sum(group_sizes) without any matmul.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from pallas_kernels.grouped_matmul import tuning

# Columns of the work-item table built by `_plan_items`.
_TILE_START, _SEG_START, _SEG_END, _GROUP = range(4)


def _grouped_matmul_kernel(items_ref, lhs_ref, rhs_ref, out_ref, *, block_m, block_k,
                           block_n, num_groups, precision):
    # items_ref: int32[W, 4]; lhs_ref: [M, K]; rhs_ref: [G, K, N]; out_ref: [M, N]
    item, col_block = pl.program_id(0), pl.program_id(1)
    num_rows, depth = lhs_ref.shape
    tile_start = items_ref[item, _TILE_START]
    group = items_ref[item, _GROUP]
    rows = tile_start + jnp.arange(block_m, dtype=jnp.int32)               # [bm]
    store_mask = (rows >= items_ref[item, _SEG_START]) & (rows < items_ref[item, _SEG_END])
    # Rows of neighbouring groups are loaded and multiplied anyway (cheaper than
    # masking); only rows past the end of lhs must not be read.
    load_mask = (rows < num_rows)[:, None]
    row_slice = pl.ds(tile_start, block_m)
    col_slice = pl.ds(col_block * block_n, block_n)
    is_real = group < num_groups   # the padding segment has group == num_groups

    def body(step, acc):
        k_slice = pl.ds(step * block_k, block_k)
        lhs = pltriton.load(lhs_ref.at[row_slice, k_slice], mask=load_mask,
                            other=0)                                       # [bm, bk]
        rhs = rhs_ref[group, k_slice, col_slice]                           # [bk, bn]
        return acc + jax.lax.dot_general(
            lhs, rhs.astype(lhs.dtype), (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)                            # [bm, bn]

    num_steps = jnp.where(is_real, depth // block_k, 0)
    acc = jax.lax.fori_loop(0, num_steps, body,
                            jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(out_ref.at[row_slice, col_slice], acc.astype(out_ref.dtype),
                   mask=store_mask[:, None])


def _plan_items(group_sizes, *, num_rows, block_m):
    """int32[W, 4] work items: tile start row, segment rows [start, end), group.

    Segments are the groups (clipped to the rows that exist) plus a padding segment up
    to num_rows. A segment touching tiles a..b needs b - a + 1 items, so
    W = cdiv(M, bm) + G + 1 covers any split; unused items have no rows.
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    seg_start = jnp.append(starts, ends[-1])                               # [G+1]
    seg_end = jnp.append(ends, num_rows)                                   # [G+1]
    first_tile = seg_start // block_m
    tiles = jnp.where(seg_end > seg_start, (seg_end - 1) // block_m - first_tile + 1, 0)
    tiles_cum = jnp.cumsum(tiles)
    num_items = -(-num_rows // block_m) + num_groups + 1
    item_ids = jnp.arange(num_items, dtype=jnp.int32)
    seg = jnp.clip(jnp.searchsorted(tiles_cum, item_ids, side="right"), 0, num_groups)
    used = item_ids < tiles_cum[-1]
    tile = first_tile[seg] + item_ids - (tiles_cum[seg] - tiles[seg])
    columns = [jnp.where(used, tile * block_m, 0), jnp.where(used, seg_start[seg], 0),
               jnp.where(used, seg_end[seg], 0), jnp.where(used, seg, num_groups)]
    return jnp.stack(columns, axis=1).astype(jnp.int32)


def check_grouped_matmul_args(lhs, rhs, group_sizes):
    """Raises ValueError naming the argument, its shape and the expectation."""
    if lhs.ndim != 2:
        raise ValueError(f"lhs has shape {tuple(lhs.shape)}, expected [M, K]")
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs has shape {tuple(rhs.shape)}, expected [G, {lhs.shape[1]}, N]"
                         " (K must match lhs)")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes has shape {tuple(group_sizes.shape)}, expected "
                         f"({rhs.shape[0]},), one size per group of rhs")
    for name, dim in (("lhs's K", lhs.shape[1]), ("rhs's N", rhs.shape[2])):
        if dim % 16:
            raise ValueError(f"{name} is {dim}, expected a multiple of 16 (Triton tiles)")


@functools.partial(jax.jit, static_argnames=(
    "interpret", "block_m", "block_k", "block_n", "num_warps", "num_stages"))
def grouped_matmul(lhs: Float[ArrayLike, "M Din"], rhs: Float[ArrayLike, "G Din Dout"],
                   group_sizes: Int[ArrayLike, " G"], *, interpret=False, block_m=None,
                   block_k=None, block_n=None, num_warps=None, num_stages=None
                   ) -> Float[Array, "M Dout"]:
    """lhs [M, K] (rows sorted by group) times rhs [G, K, N] per group -> [M, N].

    Same contract as `grouped_matmul_reference` (jax.lax.ragged_dot): fp32
    accumulation, output in lhs's dtype, rows past sum(group_sizes) are zero.
    """
    check_grouped_matmul_args(lhs, rhs, group_sizes)
    num_rows, depth = lhs.shape
    num_groups, _, width = rhs.shape
    blocks = tuning.matmul_blocks(num_rows=num_rows, num_groups=num_groups, k=depth,
                                  n=width)
    block_m = block_m or blocks.block_m
    block_k = block_k or blocks.block_k
    block_n = block_n or blocks.block_n
    for name, block, dim in (("block_m", block_m, None), ("block_k", block_k, depth),
                             ("block_n", block_n, width)):
        if block < 16 or block & (block - 1) or (dim is not None and dim % block):
            raise ValueError(f"{name} is {block}, expected a power of two >= 16"
                             + (f" dividing {dim}" if dim is not None else ""))
    items = _plan_items(group_sizes.astype(jnp.int32), num_rows=num_rows, block_m=block_m)
    precision = (jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    kernel = functools.partial(_grouped_matmul_kernel, block_m=block_m, block_k=block_k,
                               block_n=block_n, num_groups=num_groups, precision=precision)
    return pl.pallas_call(
        kernel,
        grid=(items.shape[0], width // block_n),
        out_shape=jax.ShapeDtypeStruct((num_rows, width), lhs.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or blocks.num_warps,
            num_stages=num_stages or blocks.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(items, lhs, rhs)
