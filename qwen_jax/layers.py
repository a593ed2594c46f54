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

import pallas_kernels
from pallas_kernels.choices import KernelTable, chosen
from pallas_kernels.quantized import QuantizedWeight, dequantize, stored_shapes
from qwen_jax.quantization import WeightFormat

INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Static choices of one compiled forward: kernel implementation, per-shape kernel
    choices (the device probe's table; pallas_kernels/choices.py) and device mesh."""

    impl: str = "reference"  # "pallas" | "mosaic" | "reference"
    mesh: Mesh | None = None  # None: one device, no shard_map
    kernel_table: KernelTable | None = None  # None: `impl` at every shape

    @property
    def kernels(self) -> pallas_kernels.Ops:
        """The kernel entry points of this forward."""
        kernels = pallas_kernels.ops(self.impl)
        if self.kernel_table is None or kernels.impl == "reference":
            return kernels
        return chosen(kernels, self.kernel_table)


def init_param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, std: float = INIT_STD,
               fill: float | None = None) -> nnx.Param:
    """A parameter: constant `fill`, or normal(0, std) drawn directly in `dtype` on device."""
    if fill is not None:
        return nnx.Param(jnp.full(shape, fill, dtype))
    if rngs is None:
        raise ValueError(f"a random parameter of shape {shape} needs rngs, got None")
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(std, dtype))


def no_quant(name: str) -> None:
    """The `quant` of an unquantised model: no sub-module is quantised."""
    del name


STORED_SUFFIXES = {"values": "", "scales": "_scale", "zeros": "_zero"}
# Spread of random stored values: a random quantised weight dequantises to about
# normal(0, INIT_STD) with scales INIT_STD / spread (int4: nibbles uniform on 0..15 around
# a zero point of 8, standard deviation 4.6).
_RANDOM_SPREAD = {"fp8": 64.0, "int8": 32.0, "int4": 4.6}


def random_stored(key, role: str, shape, dtype, kind: str) -> jax.Array:
    """A random stored array ("values", "scales", "zeros") of a quantised weight, drawn
    directly in its dtype: no float copy of the weight (dummy 30B weights fit)."""
    spread = _RANDOM_SPREAD[kind]
    if role == "scales":
        return jnp.full(shape, INIT_STD / spread, dtype)
    if role == "zeros":
        return jnp.full(shape, 8, dtype)
    if kind == "int4":
        return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(dtype)
    normal = jax.random.normal(key, shape, jnp.bfloat16) * spread
    if kind == "int8":
        normal = jnp.clip(jnp.round(normal), -127, 127)
    return normal.astype(dtype)


def init_weight(module: nnx.Module, name: str, rngs, shape: tuple[int, ...], dtype,
                quant: WeightFormat | None, *, pair: bool = False) -> None:
    """Sets module.<name>: a float param, or, quantised, the stored values with
    <name>_scale and <name>_zero (int4) beside it (random, see `random_stored`).
    pair: shape [..., K, 2, F], two matrices (gate and up)."""
    if quant is None:
        setattr(module, name, init_param(rngs, shape, dtype))
        return
    stored = stored_shapes(shape, quant.kind, group_k=quant.group_k, group_n=quant.group_n,
                           pair=pair)
    for role in STORED_SUFFIXES:
        value = None if role not in stored else nnx.Param(random_stored(
            rngs.params(), role, *stored[role], quant.kind))
        setattr(module, name + STORED_SUFFIXES[role], value)


def stored_weight(module: nnx.Module, name: str, quant: WeightFormat | None, *,
                  pair: bool = False):
    """module.<name> as the matmul ops take it: the float array, or a QuantizedWeight over
    the stored values and scales (read in place, dequantised inside the kernels)."""
    values = getattr(module, name)[...]
    if quant is None:
        return values
    zeros = getattr(module, f"{name}_zero")
    return QuantizedWeight(values=values, scales=getattr(module, f"{name}_scale")[...],
                           zeros=None if zeros is None else zeros[...], kind=quant.kind,
                           group_k=quant.group_k, group_n=quant.group_n, pair=pair)


class Linear(nnx.Module):
    """y = x @ kernel + bias; kernel [in, out] is the transpose of torch's `weight` [out, in].
    Quantised (`quant`), kernel holds the stored values and kernel_scale (kernel_zero) the
    scales (zero points), in pallas_kernels/quantized.py's layouts."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 quant: WeightFormat | None = None):
        self.quant = quant
        init_weight(self, "kernel", rngs, (*stack, in_features, out_features), dtype, quant)
        self.bias = (init_param(rngs, (*stack, out_features), dtype, fill=0.0)
                     if use_bias else None)

    def weight(self):
        """The kernel as the matmul ops take it (see `stored_weight`)."""
        return stored_weight(self, "kernel", self.quant)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", x, dequantize(self.weight(), x.dtype))
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
