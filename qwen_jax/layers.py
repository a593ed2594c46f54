"""Building blocks shared by the model: linear, RMSNorm, rotary embedding.

Einsum alphabet, used in every equation and shape comment of the project:
  B batch, T tokens (flattened ragged batch), S sequences, D model dim,
  N query heads, K kv heads, G query heads per kv head (N // K), H head dim,
  E experts, F FFN dim (expert or dense), V vocab, P pages, L page size,
  C context positions of one sequence (pages_per_seq * L), X stacked layers.

Parameters may carry a leading stacked-layer dim (`stack`). In the serving step the
layer scan hands each stacked module a layer index: matrices stay whole and the matmul
ops read `w[layer]` in place, while the per-layer vectors (norm weights, biases) arrive
already sliced, all of them from one table (see model.py). `Linear.__call__` and
`RMSNorm.__call__` are the per-layer views (used on sliced params, e.g. in training).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Static choices of one compiled forward: kernel implementation and device mesh."""

    impl: str = "reference"  # "pallas" | "reference"
    mesh: Mesh | None = None  # None: one device, no shard_map


def init_param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, std: float = INIT_STD,
               fill: float | None = None) -> nnx.Param:
    """A parameter: constant `fill`, or normal(0, std) drawn directly in `dtype` on device."""
    if fill is not None:
        return nnx.Param(jnp.full(shape, fill, dtype))
    if rngs is None:
        raise ValueError(f"a random parameter of shape {shape} needs rngs, got None")
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(std, dtype))


class Linear(nnx.Module):
    """y = x @ kernel + bias; kernel [in, out] is the transpose of torch's `weight` [out, in]."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.kernel = init_param(rngs, (*stack, in_features, out_features), dtype)
        self.bias = (init_param(rngs, (*stack, out_features), dtype, fill=0.0)
                     if use_bias else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class RMSNorm(nnx.Module):
    """HF Qwen3RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, *, stack: tuple[int, ...] = (), dtype=jnp.float32):
        self.weight = init_param(None, (*stack, dim), dtype, fill=1.0)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight[...] * rms_normalize(x, self.eps)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last dim, computed in fp32 and cast back (HF's order)."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_tables(positions: jax.Array, inv_freq: jax.Array, scale: float, dtype):
    """(cos, sin) [T, 1, H] in dtype for positions int32[T]; built once per step."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, H]
    cos = (jnp.cos(emb) * scale).astype(dtype)[:, None, :]  # [T, 1, H]
    sin = (jnp.sin(emb) * scale).astype(dtype)[:, None, :]
    return cos, sin


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Neox-style RoPE as HF applies it. x: [T, n, H]; cos, sin: [T, 1, H]."""
    return x * cos + rotate_half(x) * sin


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               scale: float) -> jax.Array:
    """x: [T, n, H]; positions: int32[T]; inv_freq: [H/2]."""
    return rotate(x, *rope_tables(positions, inv_freq, scale, x.dtype))
