"""Plain-jnp stacked matmul: slice the layer, dequantise, einsum, concatenate."""

import jax.numpy as jnp

from pallas_kernels.quantized import at, dequantize


def stacked_matmul_reference(x, weights, layer, *, out_dtype=None, interpret=False,
                             **block_sizes):
    """x: [M, K]; weights: [X, K, N_i] each (arrays or QuantizedWeights); layer: int32
    scalar -> [M, sum N_i].

    With out_dtype float32 the product is taken in float32 (the router's logits);
    otherwise in x's dtype. `interpret` and `block_sizes` are accepted only so it can
    stand in for the kernel.
    """
    del interpret, block_sizes
    outs = []
    for w in weights:
        if out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32:
            w = dequantize(at(w, layer), jnp.float32)                      # [K, N_i]
            outs.append(jnp.einsum("mk,kn->mn", x.astype(jnp.float32), w))
        else:
            w = dequantize(at(w, layer), x.dtype)
            outs.append(jnp.einsum("mk,kn->mn", x, w).astype(out_dtype or x.dtype))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
