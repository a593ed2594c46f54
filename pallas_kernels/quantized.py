"""Quantised weights as the matmul kernels read them, and the dequantisation they share.

A `QuantizedWeight` is the stored values, their scales (and, for int4, zero points) with
the layout as static fields. A scale group is the group_k x group_n weights sharing one
scale (fp8's `weight_block_size`, AWQ's `group_size`; "block" is kept for kernel tiles).
The kernels read the values tile by tile in place and dequantise in registers
(`weight_dot`): fp8 / int8 values are converted to the activation's dtype (exact: 8-bit
values fit bf16's mantissa), int4 nibbles are unpacked and their zero point subtracted
before the dot, and group scales multiply the dot's fp32 result for each K step (a scale
is constant over a step: a step never straddles two groups along K). Per-channel scales
multiply the accumulator once at the end. `dequantize` is the plain-jnp twin the
references use.

Kinds and layouts (our weights are [in, out] = [K, N], with any leading dims):

- fp8  (Qwen's FP8 checkpoints, `--quantization fp8`): float8_e4m3fn values [K, N];
  float32 scales [ceil(K / group_k), ceil(N / group_n)] (HF's `weight_scale_inv`,
  transposed): w[k, n] = values[k, n] * scales[k // group_k, n // group_n].
- int8 (`--quantization int8`): int8 values [K, N]; float32 scales [1, N], one per output
  channel (group_k None: the whole of K).
- int4 (AWQ checkpoints): uint8 values [K / 2, N], two rows per byte; float16 scales and
  uint8 zero points [K / group_k, N]: w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] with
  g = k // group_k. Within each group of `group_k` rows, row r < group_k / 2 sits in the low
  nibble and row r + group_k / 2 in the high nibble of byte row g * group_k / 2 + r, so a K
  step of one group reads its two halves as two plain tiles and needs no interleave.

`segment`: several matrices merged along N (gate and up, [K, 2, F] seen as [K, 2F]) keep
their own scale groups: column n of sub-matrix n // segment uses scale column
(n // segment) * ceil(segment / group_n) + (n % segment) // group_n.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

KINDS = ("fp8", "int8", "int4")
VALUE_DTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.uint8}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """Static description of one weight operand of a kernel (kind None: a float array)."""

    kind: str | None = None
    group_k: int | None = None   # K rows per scale row; None: one row for all of K
    group_n: int = 1             # columns per scale column
    segment: int | None = None   # width of each matrix merged along N; None: one matrix
    has_zeros: bool = False

    def scale_columns(self, cols):
        """Scale column of each output column (int32 vector in, int32 vector out)."""
        if self.segment is not None:
            per_segment = -(-self.segment // self.group_n)
            return (cols // self.segment) * per_segment + (cols % self.segment) // self.group_n
        return cols if self.group_n == 1 else cols // self.group_n


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedWeight:
    """values [..., K, N] (int4: [..., K/2, N]), scales [..., Kb, Nb], zeros [..., Kb, N]."""

    # Arrays, or any pytree leaves in their place (shard_map specs, abstract shapes).
    values: Any
    scales: Any
    zeros: Any = None
    kind: str = dataclasses.field(metadata=dict(static=True))
    group_k: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    group_n: int = dataclasses.field(default=1, metadata=dict(static=True))
    segment: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # pair: two matrices stored [..., K, 2, F] (scales [..., Kb, 2, Fb]), as the experts'
    # gate and up are; `merge_pair` gives the [..., K, 2F] view the kernels read.
    pair: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self):
        # Static fields only: pytree operations rebuild this class around any leaves.
        if self.kind not in KINDS:
            raise ValueError(f"kind is {self.kind!r}, expected one of {KINDS}")
        if self.kind == "int4" and (self.group_k is None or self.group_k % 32):
            raise ValueError(f"int4 weights need group_k a multiple of 32, got "
                             f"{self.group_k}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantised) shape [..., K, N] (pair: [..., K, 2, F])."""
        tail = 3 if self.pair else 2
        lead, (k, *rest) = self.values.shape[:-tail], self.values.shape[-tail:]
        return (*lead, 2 * k if self.kind == "int4" else k, *rest)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def layout(self) -> Layout:
        return Layout(kind=self.kind, group_k=self.group_k, group_n=self.group_n,
                      segment=self.segment, has_zeros=self.zeros is not None)

    def arrays(self) -> tuple[jax.Array, ...]:
        """The kernel operands, in the order `weight_dot` expects their refs."""
        return (self.values, self.scales) + (() if self.zeros is None else (self.zeros,))

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.arrays())


def stored_shapes(shape, kind: str, *, group_k: int | None = None, group_n: int = 1,
                  pair: bool = False) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """{"values" | "scales" | "zeros": (shape, dtype)} of a weight of float `shape`
    [..., K, N] (pair: [..., K, 2, F]) stored as `kind`."""
    *lead, depth, two, width = shape if pair else (*shape[:-1], None, shape[-1])
    mid = (two,) if pair else ()
    rows = 1 if group_k is None else -(-depth // group_k)
    out = {"values": ((*lead, depth // 2 if kind == "int4" else depth, *mid, width),
                      jnp.dtype(VALUE_DTYPES[kind])),
           "scales": ((*lead, rows, *mid, -(-width // group_n)),
                      jnp.dtype(jnp.float16 if kind == "int4" else jnp.float32))}
    if kind == "int4":
        out["zeros"] = ((*lead, rows, *mid, width), jnp.dtype(jnp.uint8))
    return out


def merge_pair(weight):
    """[..., K, 2, F] -> [..., K, 2F] for float arrays and pair QuantizedWeights, whose
    scales keep their own groups per matrix (`segment`)."""
    merge = lambda a: a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])
    if not isinstance(weight, QuantizedWeight):
        return merge(weight)
    if not weight.pair:
        raise ValueError("merge_pair needs a pair QuantizedWeight ([..., K, 2, F])")
    return dataclasses.replace(
        weight, values=merge(weight.values), scales=merge(weight.scales),
        zeros=None if weight.zeros is None else merge(weight.zeros),
        segment=weight.values.shape[-1], pair=False)


def check_operand(name: str, weight) -> None:
    """Kernels read [..., K, N] weights: a pair QuantizedWeight must be merged first."""
    if isinstance(weight, QuantizedWeight) and weight.pair:
        raise ValueError(f"{name} is a pair QuantizedWeight [..., K, 2, F]; kernels read "
                         "[..., K, N]: merge_pair it first")


def operands(weight) -> tuple[tuple, Layout]:
    """(kernel operands, layout) of a plain array or a QuantizedWeight."""
    check_operand("weight", weight)
    if isinstance(weight, QuantizedWeight):
        return weight.arrays(), weight.layout
    return (weight,), Layout()


def required_block_k(weights) -> int | None:
    """The K step every weight of one launch can take: int4 steps are exactly one scale
    group (its two halves); other quantised weights need steps inside one group."""
    groups = {w.group_k for w in weights if isinstance(w, QuantizedWeight) and w.kind == "int4"}
    if len(groups) > 1:
        raise ValueError(f"int4 weights of one launch have group_k {sorted(groups)}, "
                         "expected one")
    return groups.pop() if groups else None


def choose_block_k(requested: int | None, tuned: int, weights) -> int:
    """The K step (the kernel's block_k) of a launch: the requested or tuned one, halved
    until it fits inside the weights' scale groups; int4 weights step exactly one group
    (`required_block_k`)."""
    required = required_block_k(weights)
    if required is not None:
        if requested not in (None, required):
            raise ValueError(f"block_k is {requested}, expected {required} (the int4 "
                             "weights' scale group)")
        return required
    block_k = requested or tuned
    for w in weights:
        if isinstance(w, QuantizedWeight) and w.group_k is not None:
            while w.group_k % block_k:
                block_k //= 2
    return block_k


# ---- inside the kernels -----------------------------------------------------------------
def weight_dot(load_x, refs, layout: Layout, index, step, *, block_k, col_slice, cols,
               col_mask, k_mask, precision):
    """f32 [bm, bn]: K step `step` of x times the weight's tile, dequantised in registers.

    load_x(start, size) -> x [bm, size] at K offset `start`; refs: the weight's refs
    (values, scales, zeros); index: the leading indices of the weight (layer[, group]);
    cols: int32 [bn] the tile's columns (col_slice as a slice); k_mask: bool [bk] or None;
    col_mask: bool [bn] or None. Per-channel scales are left to `weight_finish`."""
    values_ref = refs[0]

    def dot(x, w):
        return jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())),
                                   precision=precision, preferred_element_type=jnp.float32)

    col_only = None if col_mask is None else col_mask[None, :]
    row_only = None if k_mask is None else k_mask[:, None]
    if layout.kind == "int4":
        half = block_k // 2
        packed = _load(values_ref.at[(*index, pl.ds(step * half, half), col_slice)],
                       col_only)                                           # [bk/2, bn] u8
        zero = _load_row(refs[2], index, step, cols, col_mask, layout=None).astype(jnp.int32)
        low = (packed & 15).astype(jnp.int32) - zero[None, :]
        high = (packed >> 4).astype(jnp.int32) - zero[None, :]
        start = step * block_k
        part = dot(load_x(start, half), low) + dot(load_x(start + half, half), high)
    else:
        mask = _both(row_only, col_only)
        w = _load(values_ref.at[(*index, pl.ds(step * block_k, block_k), col_slice)],
                  mask)                                                    # [bk, bn]
        part = dot(load_x(step * block_k, block_k), w)
    if layout.kind is not None and layout.group_k is not None:
        row = (step * block_k) // layout.group_k
        part = part * _load_row(refs[1], index, row, cols, col_mask, layout=layout)[None, :]
    return part


def _load(ref, mask):
    """A masked load (zeros where masked off), or a plain one without a mask."""
    if mask is None:
        return pltriton.load(ref)
    # A float `other`: Triton lowering cannot cast an int constant to fp8.
    zero = 0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0
    return pltriton.load(ref, mask=mask, other=zero)


def _both(a, b):
    """Elementwise `and` of two optional masks (None: everything)."""
    if a is None or b is None:
        return b if a is None else a
    return a & b


def weight_finish(acc, refs, layout: Layout, index, *, cols, col_mask):
    """Applies per-channel scales (group_k None) to the fp32 accumulator [bm, bn]."""
    if layout.kind is None or layout.group_k is not None:
        return acc
    return acc * _load_row(refs[1], index, 0, cols, col_mask, layout=layout)[None, :]


def _load_row(ref, index, row, cols, col_mask, *, layout: Layout | None):
    """One row of a scale (layout given: scale columns, as f32) or zero-point array."""
    columns = cols if layout is None else layout.scale_columns(cols)
    out = _load(ref.at[(*index, row, columns)], col_mask)
    return out if layout is None else out.astype(jnp.float32)


# ---- plain jnp: the references' dequantisation -------------------------------------------
def at(weight, index):
    """weight[index] over the leading dims, for arrays and QuantizedWeights alike."""
    return jax.tree.map(lambda a: a[index], weight)


def dequantize(weight, dtype=jnp.float32) -> jax.Array:
    """The float weight [..., K, N] (computed in fp32, returned in `dtype`)."""
    if not isinstance(weight, QuantizedWeight):
        return jnp.asarray(weight).astype(dtype)
    if weight.pair:
        return dequantize(merge_pair(weight), dtype).reshape(weight.shape)
    *lead, depth, width = weight.shape
    if weight.kind == "int4":
        values = unpack_int4(weight.values, weight.group_k).astype(jnp.float32)
        values = values - _expand_rows(weight.zeros, weight.group_k, depth).astype(jnp.float32)
    else:
        values = weight.values.astype(jnp.float32)
    cols = weight.layout.scale_columns(jnp.arange(width, dtype=jnp.int32))
    scales = jnp.take(weight.scales.astype(jnp.float32), cols, axis=-1)    # [..., Kg, N]
    scales = _expand_rows(scales, weight.group_k, depth)                  # [..., K | 1, N]
    return (values * scales).astype(dtype)


def _expand_rows(array, group, depth):
    """[..., Kg, N] -> [..., K, N] repeating each row `group` times (None: one row,
    broadcast)."""
    if group is None:
        return array
    return jnp.repeat(array, group, axis=-2, total_repeat_length=-(-depth // group) * group
                      )[..., :depth, :]


def pack_int4(q, group_k: int):
    """uint8 nibbles q [..., K, N] (values 0..15) -> [..., K/2, N] in the layout above.
    Works on numpy and jax arrays alike."""
    *lead, depth, width = q.shape
    halves = q.reshape(*lead, depth // group_k, 2, group_k // 2, width)
    packed = halves[..., 0, :, :] | (halves[..., 1, :, :] << 4)
    return packed.reshape(*lead, depth // 2, width).astype("uint8")


def unpack_int4(packed, group_k: int):
    """The inverse of `pack_int4`: [..., K/2, N] -> uint8 [..., K, N]."""
    *lead, rows, width = packed.shape
    groups = packed.reshape(*lead, rows // (group_k // 2), 1, group_k // 2, width)
    both = jnp.concatenate([groups & 15, groups >> 4], axis=-3)
    return both.reshape(*lead, 2 * rows, width)


# ---- quantisers (online quantisation, dummy weights, the checkpoint script) -------------
FP8_MAX = 448.0    # largest finite float8_e4m3fn
INT8_MAX = 127.0
INT4_MAX = 15


def quantize(w, kind: str, *, group_k: int | None = None, group_n: int = 1,
             pair: bool = False) -> QuantizedWeight:
    """Float w [..., K, N] -> QuantizedWeight, scales from each group's max (fp8: groups of
    group_k x group_n; int8: per output column; int4: AWQ's asymmetric round-to-nearest in
    groups of group_k rows, zero point per group and column). pair: w is [..., K, 2, F],
    two matrices quantised apart."""
    if pair:
        q = quantize(jnp.moveaxis(jnp.asarray(w), -2, -3), kind, group_k=group_k,
                     group_n=group_n)                                      # [..., 2, K, F]
        return jax.tree.map(lambda a: jnp.moveaxis(a, -3, -2),
                            dataclasses.replace(q, pair=True))
    w = jnp.asarray(w, jnp.float32)
    if kind == "fp8":
        # Scales multiply by a reciprocal constant: XLA may turn a division by a constant into
        # that anyway, in some fusions and not others; this way every path rounds alike.
        scales = _group_absmax(w, group_k, group_n) * (1 / FP8_MAX)
        expanded = _expand_rows(jnp.repeat(scales, group_n, axis=-1)[..., :w.shape[-1]],
                                group_k, w.shape[-2])
        values = jnp.clip(w / expanded, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        return QuantizedWeight(values=values, scales=scales, kind=kind, group_k=group_k,
                               group_n=group_n)
    if kind == "int8":
        scales = jnp.maximum(jnp.max(jnp.abs(w), axis=-2, keepdims=True), 1e-12) * (1 / INT8_MAX)
        values = jnp.clip(jnp.round(w / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return QuantizedWeight(values=values, scales=scales, kind=kind)
    if kind == "int4":
        q, scales, zeros = quantize_int4_groups(w, group_k)
        return QuantizedWeight(values=pack_int4(q, group_k), scales=scales, zeros=zeros,
                               kind=kind, group_k=group_k)
    raise ValueError(f"kind is {kind!r}, expected one of {KINDS}")


def quantize_int4_groups(w, group: int):
    """AWQ's zero-point quantisation (AutoAWQ `pseudo_quantize_tensor`, w_bit 4) of
    w [..., K, N] in groups of `group` rows: (q uint8 [..., K, N] in 0..15, scales float16
    [..., K/group, N], zeros uint8 [..., K/group, N]); w ~ (q - zero) * scale."""
    *lead, depth, width = w.shape
    groups = w.reshape(*lead, depth // group, group, width)
    high, low = groups.max(axis=-2), groups.min(axis=-2)                  # [..., G, N]
    scales = (jnp.maximum(high - low, 1e-5) * (1 / INT4_MAX)).astype(jnp.float16)
    scale32 = scales.astype(jnp.float32)
    zeros = jnp.clip(-jnp.round(low / scale32), 0, INT4_MAX)
    q = jnp.clip(jnp.round(groups / scale32[..., None, :]) + zeros[..., None, :], 0, INT4_MAX)
    return (q.reshape(*lead, depth, width).astype(jnp.uint8), scales,
            zeros.astype(jnp.uint8))


def _group_absmax(w, group_k, group_n):
    """max |w| over each group_k x group_n group (edges padded) -> [..., Kg, Ng], > 0."""
    *lead, depth, width = w.shape
    kb, nb = -(-depth // group_k), -(-width // group_n)
    pad = [(0, 0)] * len(lead) + [(0, kb * group_k - depth), (0, nb * group_n - width)]
    groups = jnp.pad(jnp.abs(w), pad).reshape(*lead, kb, group_k, nb, group_n)
    return jnp.maximum(groups.max(axis=(-3, -1)), 1e-12)
