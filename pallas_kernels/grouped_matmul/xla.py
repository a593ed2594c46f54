"""Grouped matmul through XLA's `jax.lax.ragged_dot`: a candidate the device probe times
against the Triton and Mosaic GPU kernels (pallas_kernels/choices.py may pick it per
size), not a default. On CUDA, XLA expands ragged_dot into a dense dot over every group
unless its cuDNN grouped-GEMM path engages (cuDNN >= 9.22), and it takes the layer's
[G, K, N] weights as a slice of the stack (a copy, unless XLA fuses it). It reads 16-bit
or fp32 float weights only: ragged_dot has no quantised operands.
"""

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from pallas_kernels.array_types import Array, Float, Int
from pallas_kernels.grouped_matmul.kernel import check_grouped_matmul_args
from pallas_kernels.grouped_matmul.plan import GroupPlan, group_ends_of
from pallas_kernels.quantized import QuantizedWeight

_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


@functools.partial(jax.jit, static_argnames=(
    "interpret", "block_m", "block_k", "block_n", "num_warps", "num_stages"))
def grouped_matmul_xla(lhs: Float[ArrayLike, "Mlhs Din"],
                       rhs: Float[ArrayLike, "*layers G Din Dout"],
                       group_sizes: Int[ArrayLike, " G"] | None = None, *,
                       plan: GroupPlan | None = None, layer=None, lhs_rows=None,
                       out_rows=None, interpret=False, block_m=None, block_k=None,
                       block_n=None, num_warps=None, num_stages=None
                       ) -> Float[Array, "M Dout"]:
    """`grouped_matmul`'s contract and arguments through `jax.lax.ragged_dot` (fp32
    accumulation, output in lhs's dtype, rows past the last group zero). `interpret` and
    the block sizes are accepted so it can stand in for the kernels, and ignored."""
    del interpret, block_m, block_k, block_n, num_warps, num_stages
    if isinstance(rhs, QuantizedWeight):
        raise ValueError(f"rhs is a {rhs.kind} QuantizedWeight: ragged_dot reads float "
                         "weights only; use the Triton kernel (grouped_matmul)")
    if rhs.dtype not in _FLOATS:
        raise ValueError(f"rhs has dtype {rhs.dtype}, expected bfloat16, float16 or "
                         "float32")
    num_rows = check_grouped_matmul_args(lhs, rhs, group_sizes, layer=layer,
                                         lhs_rows=lhs_rows, out_rows=out_rows, plan=plan,
                                         tiled=False)
    if group_sizes is None:
        group_sizes = plan.group_sizes
    # ragged_dot's groups must not pass the rows: clip as the kernels' plans do.
    ends = group_ends_of(group_sizes, num_rows)                            # [G]
    sizes = ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    weights = (rhs if layer is None else rhs[layer]).astype(lhs.dtype)    # [G, K, N]
    rows = lhs if lhs_rows is None else lhs[lhs_rows]                      # [M, K]
    precision = (jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    out = jax.lax.ragged_dot(rows, weights, sizes, precision=precision,
                             preferred_element_type=jnp.float32).astype(lhs.dtype)
    if out_rows is not None:
        out = jnp.zeros_like(out).at[out_rows].set(out, unique_indices=True)
    return out
