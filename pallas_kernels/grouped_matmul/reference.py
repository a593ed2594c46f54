"""Plain-jnp grouped matmul: `jax.lax.ragged_dot` with fp32 accumulation."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int


def grouped_matmul_reference(lhs: Float[ArrayLike, "M Din"], rhs: Float[ArrayLike, "G Din Dout"],
                             group_sizes: Int[ArrayLike, " G"], *, interpret=False,
                             **block_sizes) -> Float[Array, "M Dout"]:
    """lhs: [M, K] rows sorted by group; rhs: [G, K, N]; group_sizes: int32[G] -> [M, N].

    Rows past sum(group_sizes) are zero. `interpret` and `block_sizes` are accepted only
    so it can stand in for the kernel.
    """
    del interpret, block_sizes
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)
