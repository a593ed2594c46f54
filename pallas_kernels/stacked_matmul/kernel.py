"""Dense matmul of a layer's weights read in place from their stacked array.

`x [M, K] @ concat_i(w_i[layer])` with every `w_i` a whole `[X, K, N_i]` stack and
`layer` a traced index: inside the layer scan the weights are never sliced (an XLA
dynamic slice feeding a custom call or a cuBLAS gemm is a copy of the layer's weights).
Several weights that read the same `x` (q, k and v; gate and up) share one launch: a
column block belongs to one weight, picked with `pl.when`, and the outputs are
concatenated along N.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.stacked_matmul import tuning


def _matmul_loop(x_ref, w_ref, *, layer, row_start, row_mask, col_start, col_mask,
                 block_k, precision):
    """[bm, bn] float32: x rows times w[layer][:, col_start:col_start + bn] (masked past
    the weight's columns and past K)."""
    depth = x_ref.shape[1]
    block_m, block_n = row_mask.shape[0], col_mask.shape[0]

    def body(step, acc):
        k_mask = step * block_k + jnp.arange(block_k, dtype=jnp.int32) < depth  # [bk]
        x = pltriton.load(x_ref.at[pl.ds(row_start, block_m), pl.ds(step * block_k, block_k)],
                          mask=row_mask[:, None] & k_mask[None, :], other=0)  # [bm, bk]
        w = pltriton.load(w_ref.at[layer, pl.ds(step * block_k, block_k),
                                   pl.ds(col_start, block_n)],
                          mask=k_mask[:, None] & col_mask[None, :], other=0)  # [bk, bn]
        return acc + jax.lax.dot_general(
            x, w.astype(x.dtype), (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)                            # [bm, bn]

    return jax.lax.fori_loop(0, pl.cdiv(depth, block_k), body,
                             jnp.zeros((block_m, block_n), jnp.float32))


def _stacked_matmul_kernel(layer_ref, x_ref, *refs, bounds, offsets, block_m, block_k,
                           block_n, precision):
    # layer_ref: int32[1]; x_ref: [M, K]; refs: w_i [X, K, N_i]..., o_ref [M, sum N_i]
    # bounds: first column block of each weight, and the total; offsets: first output
    # column of each weight.
    *w_refs, o_ref = refs
    row_block, col_block = pl.program_id(0), pl.program_id(1)
    rows = row_block * block_m + jnp.arange(block_m, dtype=jnp.int32)      # [bm]
    row_mask = rows < x_ref.shape[0]
    layer = layer_ref[0]
    for w_ref, first, last, offset in zip(w_refs, bounds[:-1], bounds[1:], offsets):
        def one_weight(w_ref=w_ref, first=first, offset=offset):
            col_start = (col_block - first) * block_n
            cols = col_start + jnp.arange(block_n, dtype=jnp.int32)         # [bn]
            col_mask = cols < w_ref.shape[2]
            acc = _matmul_loop(x_ref, w_ref, layer=layer, row_start=row_block * block_m,
                               row_mask=row_mask, col_start=col_start, col_mask=col_mask,
                               block_k=block_k, precision=precision)
            pltriton.store(o_ref.at[pl.ds(row_block * block_m, block_m),
                                    pl.ds(offset + col_start, block_n)],
                           acc.astype(o_ref.dtype), mask=row_mask[:, None] & col_mask[None, :])
        if len(w_refs) == 1:
            one_weight()
        else:
            pl.when((col_block >= first) & (col_block < last))(one_weight)


def check_stacked_matmul_args(x, weights, layer):
    """Raises ValueError naming the argument, its shape and the expectation."""
    if x.ndim != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [M, K]")
    if not weights:
        raise ValueError("weights is empty, expected at least one [X, K, N] array")
    for i, w in enumerate(weights):
        if w.ndim != 3 or w.shape[1] != x.shape[1] or w.shape[0] != weights[0].shape[0]:
            raise ValueError(f"weights[{i}] has shape {tuple(w.shape)}, expected "
                             f"[{weights[0].shape[0]}, {x.shape[1]}, N] (stacked layers, "
                             "K = x's last dim)")
    if jnp.shape(layer) != ():
        raise ValueError(f"layer has shape {jnp.shape(layer)}, expected a scalar")


@functools.partial(jax.jit, static_argnames=(
    "out_dtype", "interpret", "block_m", "block_k", "block_n", "num_warps", "num_stages"))
def stacked_matmul(x, weights, layer, *, out_dtype=None, interpret=False, block_m=None,
                   block_k=None, block_n=None, num_warps=None, num_stages=None):
    """x [M, K] times each w[layer] of weights ([X, K, N_i] each) -> [M, sum N_i].

    Same contract as `stacked_matmul_reference`: fp32 accumulation, output in
    `out_dtype` (default x's dtype), the weights' outputs concatenated in order. Any K
    and N: tiles are masked at the edges.
    """
    weights = tuple(weights)
    check_stacked_matmul_args(x, weights, layer)
    num_rows, depth = x.shape
    widths = [w.shape[2] for w in weights]
    blocks = tuning.matmul_blocks(num_rows=num_rows, k=depth, widths=widths)
    block_m = block_m or blocks.block_m
    block_k = block_k or blocks.block_k
    block_n = block_n or blocks.block_n
    for name, block in (("block_m", block_m), ("block_k", block_k), ("block_n", block_n)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} is {block}, expected a power of two >= 16")
    bounds, offsets = [0], [0]
    for width in widths:
        bounds.append(bounds[-1] + pl.cdiv(width, block_n))
        offsets.append(offsets[-1] + width)
    precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    kernel = functools.partial(_stacked_matmul_kernel, bounds=tuple(bounds),
                               offsets=tuple(offsets[:-1]), block_m=block_m, block_k=block_k,
                               block_n=block_n,
                               precision=precision)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_m), bounds[-1]),
        out_shape=jax.ShapeDtypeStruct((num_rows, sum(widths)), out_dtype or x.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or blocks.num_warps,
            num_stages=num_stages or blocks.num_stages),
        interpret=interpret,
        name="stacked_matmul",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), x, *weights)
