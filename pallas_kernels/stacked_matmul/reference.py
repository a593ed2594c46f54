"""Plain-jnp stacked matmul: slice the layer, einsum, concatenate."""

import jax.numpy as jnp


def stacked_matmul_reference(x, weights, layer, *, out_dtype=None, interpret=False,
                             **block_sizes):
    """x: [M, K]; weights: [X, K, N_i] each; layer: int32 scalar -> [M, sum N_i].

    With out_dtype float32 the product is taken in float32 (the router's logits);
    otherwise in x's dtype. `interpret` and `block_sizes` are accepted only so it can
    stand in for the kernel.
    """
    del interpret, block_sizes
    outs = []
    for w in weights:
        w = w[layer]                                                       # [K, N_i]
        if out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32:
            outs.append(jnp.einsum("mk,kn->mn", x.astype(jnp.float32), w.astype(jnp.float32)))
        else:
            outs.append(jnp.einsum("mk,kn->mn", x, w).astype(out_dtype or x.dtype))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
