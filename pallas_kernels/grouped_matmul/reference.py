"""Plain-jnp grouped matmul: `jax.lax.ragged_dot` with fp32 accumulation."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from pallas_kernels.array_types import Array, Float, Int
from pallas_kernels.quantized import at, dequantize


def grouped_matmul_reference(lhs: Float[ArrayLike, "Mlhs Din"],
                             rhs: Float[ArrayLike, "*layers G Din Dout"],
                             group_sizes: Int[ArrayLike, " G"] | None = None, *, plan=None,
                             layer=None, lhs_rows=None, out_rows=None, interpret=False,
                             **block_sizes) -> Float[Array, "M Dout"]:
    """lhs: [M, K] rows sorted by group; rhs: [G, K, N]; group_sizes: int32[G] -> [M, N].

    Rows past sum(group_sizes) are zero. `plan` may replace group_sizes; `layer` picks
    rhs[layer] of a stacked [X, G, K, N]; `lhs_rows` reads lhs[lhs_rows]; `out_rows`
    stores row r at out_rows[r] (see the kernel). A quantised rhs (`QuantizedWeight`) is
    dequantised to lhs's dtype first. `interpret` and `block_sizes` are accepted only so
    it can stand in for the kernel.
    """
    del interpret, block_sizes
    if group_sizes is None:
        group_sizes = plan.group_sizes
    if layer is not None:
        rhs = at(rhs, layer)
    rhs = dequantize(rhs, lhs.dtype)
    if lhs_rows is not None:
        lhs = lhs[lhs_rows]
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32).astype(lhs.dtype)
    if out_rows is not None:
        out = jnp.zeros_like(out).at[out_rows].set(out)
    return out
