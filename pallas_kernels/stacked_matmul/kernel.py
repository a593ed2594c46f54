"""Dense matmul of a layer's weights read in place from their stacked array.

`x [M, K] @ concat_i(w_i[layer])` with every `w_i` a whole `[X, K, N_i]` stack and
`layer` a traced index: inside the layer scan the weights are never sliced (an XLA
dynamic slice feeding a custom call or a cuBLAS gemm is a copy of the layer's weights).
Several weights that read the same `x` (q, k and v; gate and up) share one launch: a
column block belongs to one weight, picked with `pl.when`, and the outputs are
concatenated along N.

Where it runs: impl "pallas" and "mosaic" alike on a GPU (no Mosaic GPU variant has
been written); on a CPU only with `interpret=True` (the tests).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.quantized import (
    check_operand,
    choose_block_k,
    operands,
    weight_dot,
    weight_finish,
)
from pallas_kernels.stacked_matmul import tuning


def _matmul_loop(x_ref, w_refs, layout, *, layer, row_start, row_mask, col_start, col_mask,
                 depth, block_k, precision):
    """[bm, bn] float32: x rows times w[layer][:, col_start:col_start + bn] (masked past
    the weight's columns and past K), dequantised in registers when w is quantised."""
    block_m, block_n = row_mask.shape[0], col_mask.shape[0]
    cols = col_start + jnp.arange(block_n, dtype=jnp.int32)                # [bn]

    def load_x(start, size):
        k_mask = start + jnp.arange(size, dtype=jnp.int32) < depth
        return pltriton.load(x_ref.at[pl.ds(row_start, block_m), pl.ds(start, size)],
                             mask=row_mask[:, None] & k_mask[None, :], other=0)

    def body(step, acc):
        k_mask = step * block_k + jnp.arange(block_k, dtype=jnp.int32) < depth  # [bk]
        return acc + weight_dot(load_x, w_refs, layout, (layer,), step, block_k=block_k,
                                col_slice=pl.ds(col_start, block_n), cols=cols,
                                col_mask=col_mask, k_mask=k_mask, precision=precision)

    acc = jax.lax.fori_loop(0, pl.cdiv(depth, block_k), body,
                            jnp.zeros((block_m, block_n), jnp.float32))
    return weight_finish(acc, w_refs, layout, (layer,), cols=cols, col_mask=col_mask)


def _stacked_matmul_kernel(layer_ref, x_ref, *refs, layouts, bounds, offsets, widths,
                           block_m, block_k, block_n, precision):
    # layer_ref: int32[1]; x_ref: [M, K]; refs: each weight's operands (values [X, K, N_i]
    # or [X, K/2, N_i], then its scales and zero points when quantised), o_ref
    # [M, sum N_i]. bounds: first column block of each weight, and the total; offsets:
    # first output column of each weight.
    *w_refs, o_ref = refs
    row_block, col_block = pl.program_id(0), pl.program_id(1)
    rows = row_block * block_m + jnp.arange(block_m, dtype=jnp.int32)      # [bm]
    row_mask = rows < x_ref.shape[0]
    layer = layer_ref[0]
    groups, start = [], 0
    for layout in layouts:
        count = 1 if layout.kind is None else 2 + layout.has_zeros
        groups.append(tuple(w_refs[start:start + count]))
        start += count
    for refs_i, layout, first, last, offset, width in zip(groups, layouts, bounds[:-1],
                                                          bounds[1:], offsets, widths):
        def one_weight(refs_i=refs_i, layout=layout, first=first, offset=offset,
                       width=width):
            col_start = (col_block - first) * block_n
            cols = col_start + jnp.arange(block_n, dtype=jnp.int32)         # [bn]
            col_mask = cols < width
            acc = _matmul_loop(x_ref, refs_i, layout, layer=layer,
                               row_start=row_block * block_m, row_mask=row_mask,
                               col_start=col_start, col_mask=col_mask,
                               depth=x_ref.shape[1], block_k=block_k, precision=precision)
            pltriton.store(o_ref.at[pl.ds(row_block * block_m, block_m),
                                    pl.ds(offset + col_start, block_n)],
                           acc.astype(o_ref.dtype), mask=row_mask[:, None] & col_mask[None, :])
        if len(layouts) == 1:
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
        check_operand(f"weights[{i}]", w)
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
    and N: tiles are masked at the edges. A weight may be a `QuantizedWeight`: its values
    are read in place and dequantised in registers (pallas_kernels/quantized.py).
    """
    weights = tuple(weights)
    check_stacked_matmul_args(x, weights, layer)
    num_rows, depth = x.shape
    widths = [w.shape[2] for w in weights]  # a QuantizedWeight's shape is the float one
    blocks = tuning.matmul_blocks(num_rows=num_rows, k=depth, widths=widths)
    block_m = block_m or blocks.block_m
    block_k = choose_block_k(block_k, blocks.block_k, weights)
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
    arrays, layouts = zip(*(operands(w) for w in weights))
    kernel = functools.partial(_stacked_matmul_kernel, layouts=layouts, bounds=tuple(bounds),
                               offsets=tuple(offsets[:-1]), widths=tuple(widths),
                               block_m=block_m, block_k=block_k, block_n=block_n,
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
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), x, *(a for op in arrays for a in op))

