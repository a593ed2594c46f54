"""Grouped matmul (ragged_dot semantics) as a Triton-backed Pallas kernel.

Rows are cut into `block_m` tiles; a tile that straddles a group boundary is visited
once per group it touches, each visit multiplying by that group's weights and storing
only its own rows. Each program finds its (group, tile) from a `GroupPlan` (plan.py)
with one vector compare, so the plan is one cumulative sum in XLA, shared by every call
of a layer. A trailing padding segment writes zeros past the last group without any
matmul.

For a MoE layer the kernel also reads its rows through `lhs_rows` (the token of each
expert-sorted pair: no gathered copy of the tokens), stores them through `out_rows` (back
in (token, slot) order: no scatter), and takes the layer's weights from the whole
stacked `[X, G, K, N]` array with a `layer` index, so no per-layer slice is copied.

Where it runs: every grouped matmul of impl "pallas" on a GPU, and under impl "mosaic"
the calls the Mosaic GPU kernel (mosaic.py) leaves: decode-sized plans, quantised
weights, fp32. It is the only implementation that reads every weight format in place.
On a CPU it runs only with `interpret=True` (the tests).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.typing import ArrayLike

from pallas_kernels.array_types import Array, Float, Int
from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.plan import GroupPlan, group_ends_of, plan_groups, plan_width
from pallas_kernels.quantized import (
    QuantizedWeight,
    at,
    check_operand,
    choose_block_k,
    operands,
    weight_dot,
    weight_finish,
)


def _locate(tiles_cum_ref, ends_ref, item, *, num_rows, block_m):
    """Segment of work item `item`: (tile start row, first row, end row, group).

    group == G is the padding segment; group == G + 1 an unused item (no rows)."""
    num_groups = ends_ref.shape[0]
    # The plan is padded to the loaded width with NO_ITEM: a whole-ref load, no mask.
    cum = tiles_cum_ref[pl.ds(0, plan_width(num_groups))]                  # [pow2 >= G+1]
    seg = jnp.sum((cum <= item).astype(jnp.int32))
    before = jnp.where(seg > 0, tiles_cum_ref[jnp.clip(seg - 1, 0, num_groups)], 0)
    start = jnp.where(seg > 0, ends_ref[jnp.clip(seg - 1, 0, num_groups - 1)], 0)
    end = jnp.where(seg < num_groups, ends_ref[jnp.minimum(seg, num_groups - 1)], num_rows)
    used = seg <= num_groups
    tile_start = (start // block_m + item - before) * block_m
    return (jnp.where(used, tile_start, 0), jnp.where(used, start, 0),
            jnp.where(used, end, 0), seg)


def _grouped_matmul_kernel(*refs, layout, block_m, block_k, block_n, num_rows, gather_lhs,
                           scatter_out, precision):
    # tiles_cum_ref: int32[plan_width(G)]; ends_ref: int32[G]; layer_ref: int32[1]
    # lhs_rows_ref, out_rows_ref (optional): int32[M]; lhs_ref: [M', K]
    # rhs refs: values [X, G, K, N] (int4: [X, G, K/2, N]), then scales and zero points
    # when quantised; out_ref: [M, N]
    tiles_cum_ref, ends_ref, layer_ref, *refs = refs
    lhs_rows_ref = refs.pop(0) if gather_lhs else None
    out_rows_ref = refs.pop(0) if scatter_out else None
    lhs_ref, *rhs_refs, out_ref = refs
    item, col_block = pl.program_id(0), pl.program_id(1)
    num_groups, depth = ends_ref.shape[0], lhs_ref.shape[1]
    tile_start, start, end, group = _locate(tiles_cum_ref, ends_ref, item,
                                            num_rows=num_rows, block_m=block_m)
    rows = tile_start + jnp.arange(block_m, dtype=jnp.int32)               # [bm]
    in_rows = rows < num_rows
    store_mask = ((rows >= start) & (rows < end))[:, None]
    index = (layer_ref[0], group)
    cols = col_block * block_n + jnp.arange(block_n, dtype=jnp.int32)      # [bn]
    col_slice = pl.ds(col_block * block_n, block_n)
    if gather_lhs:
        src = pltriton.load(lhs_rows_ref.at[rows], mask=in_rows, other=0)  # [bm]

    def load_lhs(k_start, size):
        # Rows of neighbouring groups are loaded and multiplied anyway (cheaper than
        # masking); only rows past the end must not be read.
        if gather_lhs:
            k_ids = k_start + jnp.arange(size, dtype=jnp.int32)            # [size]
            return pltriton.load(lhs_ref.at[src[:, None], k_ids[None, :]],
                                 mask=in_rows[:, None], other=0)           # [bm, size]
        return pltriton.load(lhs_ref.at[pl.ds(tile_start, block_m), pl.ds(k_start, size)],
                             mask=in_rows[:, None], other=0)

    def body(step, acc):
        return acc + weight_dot(load_lhs, rhs_refs, layout, index, step, block_k=block_k,
                                col_slice=col_slice, cols=cols, col_mask=None, k_mask=None,
                                precision=precision)                       # [bm, bn]

    num_steps = jnp.where(group < num_groups, depth // block_k, 0)
    acc = jax.lax.fori_loop(0, num_steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    acc = weight_finish(acc, rhs_refs, layout, (index[0], jnp.minimum(group, num_groups - 1)),
                        cols=cols, col_mask=None)
    out = acc.astype(out_ref.dtype)
    if scatter_out:
        dst = pltriton.load(out_rows_ref.at[rows], mask=in_rows, other=0)  # [bm]
        pltriton.store(out_ref.at[dst[:, None], cols[None, :]], out, mask=store_mask)
    else:
        pltriton.store(out_ref.at[pl.ds(tile_start, block_m), col_slice], out,
                       mask=store_mask)


def check_grouped_matmul_args(lhs, rhs, group_sizes, *, layer=None, lhs_rows=None,
                              out_rows=None, plan=None, tiled=True):
    """Raises ValueError naming the argument, its shape and the expectation; returns the
    rows M. `tiled`: K and N must also fit the kernels' tiles (XLA's needs no tiles)."""
    if lhs.ndim != 2:
        raise ValueError(f"lhs has shape {tuple(lhs.shape)}, expected [M, K]")
    check_operand("rhs", rhs)
    expected_rank = 3 if layer is None else 4
    if rhs.ndim != expected_rank or rhs.shape[-2] != lhs.shape[1]:
        dims = "[G, K, N]" if layer is None else "[X, G, K, N] (stacked, with layer)"
        raise ValueError(f"rhs has shape {tuple(rhs.shape)}, expected {dims} with K = "
                         f"{lhs.shape[1]} (lhs's K)")
    num_groups = rhs.shape[-3]
    if group_sizes is None and plan is None:
        raise ValueError("group_sizes is None: pass group_sizes or a plan")
    if group_sizes is not None and group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes has shape {tuple(group_sizes.shape)}, expected "
                         f"({num_groups},), one size per group of rhs")
    if plan is not None and plan.num_groups != num_groups:
        raise ValueError(f"plan has {plan.num_groups} groups, expected {num_groups} (rhs)")
    num_rows = lhs.shape[0] if lhs_rows is None else lhs_rows.shape[0]
    for name, rows in (("lhs_rows", lhs_rows), ("out_rows", out_rows)):
        if rows is not None and rows.shape != (num_rows,):
            raise ValueError(f"{name} has shape {tuple(rows.shape)}, expected ({num_rows},)")
    if plan is not None and plan.num_rows != num_rows:
        raise ValueError(f"plan covers {plan.num_rows} rows, expected {num_rows}")
    dims = (("lhs's K", lhs.shape[1]), ("rhs's N", rhs.shape[-1])) if tiled else ()
    for name, dim in dims:
        if dim % 16:
            raise ValueError(f"{name} is {dim}, expected a multiple of 16 (Triton tiles)")
    return num_rows


def _check_blocks(block_m, block_k, block_n, depth, width):
    for name, block, dim in (("block_m", block_m, None), ("block_k", block_k, depth),
                             ("block_n", block_n, width)):
        if block < 16 or block & (block - 1) or (dim is not None and dim % block):
            raise ValueError(f"{name} is {block}, expected a power of two >= 16"
                             + (f" dividing {dim}" if dim is not None else ""))


@functools.partial(jax.jit, static_argnames=(
    "interpret", "block_m", "block_k", "block_n", "num_warps", "num_stages"))
def grouped_matmul(lhs: Float[ArrayLike, "Mlhs Din"],
                   rhs: Float[ArrayLike, "*layers G Din Dout"] | QuantizedWeight,
                   group_sizes: Int[ArrayLike, " G"] | None = None, *,
                   plan: GroupPlan | None = None, layer=None, lhs_rows=None, out_rows=None,
                   interpret=False, block_m=None, block_k=None, block_n=None, num_warps=None,
                   num_stages=None) -> Float[Array, "M Dout"]:
    """lhs [M, K] (rows sorted by group) times rhs [G, K, N] per group -> [M, N]; rhs may
    be a `QuantizedWeight` (read in place, dequantised in registers).

    Same contract as `grouped_matmul_reference` (jax.lax.ragged_dot): fp32
    accumulation, output in lhs's dtype, rows past the last group are zero. Options:
    `plan` instead of group_sizes (built once, shared by calls); `layer` with a stacked
    rhs [X, G, K, N]; `lhs_rows` int32[M]: row r reads lhs[lhs_rows[r]] (then lhs may
    have any number of rows); `out_rows` int32[M], a permutation: row r is stored at
    out[out_rows[r]].
    """
    num_rows = check_grouped_matmul_args(lhs, rhs, group_sizes, layer=layer,
                                         lhs_rows=lhs_rows, out_rows=out_rows, plan=plan)
    depth, width = lhs.shape[1], rhs.shape[-1]
    num_groups = rhs.shape[-3]
    blocks = tuning.matmul_blocks(num_rows=num_rows, num_groups=num_groups, k=depth,
                                  n=width)
    if plan is not None:
        if block_m not in (None, plan.block_m):
            raise ValueError(f"block_m is {block_m}, expected the plan's {plan.block_m}")
        block_m = plan.block_m
    block_m = block_m or blocks.block_m
    block_k = choose_block_k(block_k, blocks.block_k, (rhs,))
    block_n = block_n or blocks.block_n
    _check_blocks(block_m, block_k, block_n, depth, width)
    if plan is None:
        plan = plan_groups(group_ends_of(group_sizes, num_rows), num_rows=num_rows,
                           block_m=block_m)
    rhs4 = at(rhs, None) if layer is None else rhs                         # [X, G, K, N]
    arrays, layout = operands(rhs4)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    precision = (jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    kernel = functools.partial(
        _grouped_matmul_kernel, layout=layout, block_m=block_m, block_k=block_k, block_n=block_n,
        num_rows=num_rows, gather_lhs=lhs_rows is not None,
        scatter_out=out_rows is not None, precision=precision)
    row_maps = [r.astype(jnp.int32) for r in (lhs_rows, out_rows) if r is not None]
    return pl.pallas_call(
        kernel,
        grid=(plan.num_items, width // block_n),
        out_shape=jax.ShapeDtypeStruct((num_rows, width), lhs.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or blocks.num_warps,
            num_stages=num_stages or blocks.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(plan.tiles_cum, plan.ends, layer_arr, *row_maps, lhs, *arrays)
