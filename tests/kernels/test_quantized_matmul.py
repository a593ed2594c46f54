"""Quantised weights in the matmul kernels: the kernels (interpreted) against their jnp
references, the references' dequantisation against a float64 numpy oracle, the
quantisers' error bounds, and the CUDA lowering at Qwen3-30B-A3B shapes.

Tolerances: kernel vs reference 1e-4 (fp32) / 2e-2 (bf16) relative to the output scale,
as for float weights: both multiply the same stored values; the kernel scales each
block's fp32 partial product, the reference scales the weights first (order only).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernel_cases import BF16, INTERPRET, as_float
from pallas_kernels import (
    grouped_matmul,
    grouped_matmul_reference,
    plan_groups,
    stacked_matmul,
    stacked_matmul_reference,
)
from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.grouped_matmul import group_ends_of
from pallas_kernels.quantized import (
    QuantizedWeight,
    dequantize,
    merge_pair,
    pack_int4,
    quantize,
    unpack_int4,
)

FORMATS = {  # kind -> quantize() options at test shapes (several blocks per matrix)
    "fp8": dict(group_k=32, group_n=32),
    "int8": {},
    "int4": dict(group_k=32),
}


def _oracle(weight: QuantizedWeight) -> np.ndarray:
    """float64 [..., K, N] from the stored arrays by the layouts' definitions, loop-free
    but independent of `dequantize`: every element looks up its own scale."""
    k, n = weight.shape[-2:]
    rows, cols = np.arange(k)[:, None], np.arange(n)[None, :]
    group_k = weight.group_k or k
    scales = np.asarray(weight.scales, np.float64)
    if weight.segment is not None:
        per = -(-weight.segment // weight.group_n)
        scale_cols = cols // weight.segment * per + cols % weight.segment // weight.group_n
    else:
        scale_cols = cols // weight.group_n
    scale = scales[..., rows // group_k, scale_cols]
    if weight.kind != "int4":
        return np.asarray(weight.values).astype(np.float64) * scale
    packed = np.asarray(weight.values)
    half = group_k // 2
    # row r of block b: low nibble (r < half) or high nibble of byte row b * half + r % half
    byte_rows = rows // group_k * half + rows % half
    nibble = np.where(rows % group_k < half, packed[..., byte_rows, cols] & 15,
                      packed[..., byte_rows, cols] >> 4).astype(np.float64)
    zeros = np.asarray(weight.zeros).astype(np.float64)[..., rows // group_k, cols]
    return (nibble - zeros) * scale


@pytest.mark.parametrize("kind", FORMATS)
def test_dequantize_matches_the_layout_definition(kind):
    w = np.random.default_rng(0).standard_normal((2, 96, 80)).astype(np.float32)
    q = quantize(w, kind, **FORMATS[kind])
    np.testing.assert_allclose(np.asarray(dequantize(q)), _oracle(q), rtol=1e-6, atol=1e-7)
    pair = merge_pair(quantize(w.reshape(2, 96, 2, 40), kind, pair=True, **FORMATS[kind]))
    assert pair.segment == 40 and pair.shape == (2, 96, 80)
    np.testing.assert_allclose(np.asarray(dequantize(pair)), _oracle(pair), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("kind,bound", [
    ("fp8", 2.0 ** -4),   # e4m3: 3 mantissa bits, half an ulp of the value
    ("int8", 0.5 / 127),  # half a step of max|column| / 127
    ("int4", 0.5 / 15),   # half a step of (max - min) / 15 of each group
])
def test_quantisers_round_to_nearest_within_half_a_step(kind, bound):
    w = np.random.default_rng(1).standard_normal((3, 128, 96)).astype(np.float32)
    q = quantize(w, kind, **FORMATS[kind])
    error = np.abs(np.asarray(dequantize(q)) - w)
    if kind == "fp8":
        # relative to the value, plus e4m3's subnormal step (2^-9 of the block's scale)
        scale = np.repeat(np.repeat(np.asarray(q.scales), 32, -2), 32, -1)
        assert np.all(error <= np.abs(w) * bound + scale * 2.0 ** -9 + 1e-7)
    elif kind == "int8":
        assert np.all(error <= np.abs(w).max(axis=-2, keepdims=True) * bound * 1.0001)
    else:
        groups = w.reshape(3, 4, 32, 96)
        spread = np.repeat(groups.max(2) - groups.min(2), 32, axis=1)
        assert np.all(error <= spread * bound * 1.01 + 1e-6)


def test_int4_packing_round_trips_and_keeps_block_halves_apart():
    q = np.random.default_rng(2).integers(0, 16, (2, 64, 24)).astype(np.uint8)
    packed = pack_int4(q, 32)
    assert packed.shape == (2, 32, 24) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed[:, 16] & 15, q[:, 32])   # row 0 of block 1
    np.testing.assert_array_equal(packed[:, 16] >> 4, q[:, 48])   # its row 16
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, 32)), q)


def _stack(rng, layers, depth, widths, kind):
    return tuple(quantize(rng.standard_normal((layers, depth, n)) / np.sqrt(depth), kind,
                          **FORMATS[kind]) for n in widths)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_stacked_matmul_reads_quantized_weights_at_every_layer(kind, dtype):
    rng = np.random.default_rng(3)
    # q, k and v sharing one launch; 40 columns: a partial fp8 block and a masked edge.
    weights = _stack(rng, 3, 96, (64, 40, 32), kind)
    x = jnp.asarray(rng.standard_normal((21, 96)), dtype)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    outs = []
    for layer in range(3):
        out = stacked_matmul(x, weights, jnp.int32(layer), interpret=INTERPRET, block_m=16,
                             block_n=16)
        expected = stacked_matmul_reference(x, weights, jnp.int32(layer))
        assert out.shape == (21, 136) and out.dtype == x.dtype
        np.testing.assert_allclose(as_float(out) / 3, as_float(expected) / 3, atol=tol, rtol=tol)
        oracle = np.asarray(x, np.float64) @ np.concatenate(
            [_oracle(w)[layer] for w in weights], axis=1)
        np.testing.assert_allclose(as_float(out) / 3, oracle / 3, atol=2 * tol, rtol=2 * tol)
        outs.append(as_float(out))
    assert not np.allclose(outs[0], outs[1]), "each layer reads its own weights"


def _moe_case(rng, num_tokens=13, top_k=2, num_experts=5):
    ids = rng.integers(0, num_experts + 1, num_tokens * top_k)  # E: pairs computed elsewhere
    order = np.argsort(ids, kind="stable").astype(np.int32)
    sizes = np.bincount(ids, minlength=num_experts + 1)[:num_experts].astype(np.int32)
    plan = plan_groups(group_ends_of(jnp.asarray(sizes), len(ids)), num_rows=len(ids),
                       block_m=16)
    return ids, order, sizes, plan


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_grouped_matmul_moe_form_with_quantized_experts(kind, dtype):
    # gate/up as the model stores it: [X, E, D, 2, F] with F = 40 (not a multiple of the
    # fp8 block: each matrix keeps its own scale columns), merged to [X, E, D, 2F].
    rng = np.random.default_rng(4)
    ids, order, sizes, plan = _moe_case(rng)
    x = jnp.asarray(rng.standard_normal((13, 64)), dtype)
    gate_up = merge_pair(quantize(rng.standard_normal((3, 5, 64, 2, 40)) / 8, kind, pair=True,
                                  **FORMATS[kind]))
    tol = 1e-4 if dtype == np.float32 else 2e-2
    for layer in (0, 2):
        kwargs = dict(layer=jnp.int32(layer), lhs_rows=order // 2, out_rows=order)
        out = grouped_matmul(x, gate_up, plan=plan, interpret=INTERPRET, block_n=16, **kwargs)
        expected = grouped_matmul_reference(x, gate_up, jnp.asarray(sizes), **kwargs)
        np.testing.assert_allclose(as_float(out) / 3, as_float(expected) / 3, atol=tol,
                                   rtol=tol)
        weights = _oracle(gate_up)[layer]                                   # [E, D, 2F]
        by_hand = np.zeros((len(ids), 80))
        for p, e in enumerate(ids):
            if e < 5:
                by_hand[p] = np.asarray(x[p // 2], np.float64) @ weights[e]
        np.testing.assert_allclose(as_float(out) / 3, by_hand / 3, atol=2 * tol, rtol=2 * tol)


def test_int4_steps_one_scale_group_at_a_time():
    rng = np.random.default_rng(5)
    (w,) = _stack(rng, 1, 64, (32,), "int4")
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    with pytest.raises(ValueError, match="block_k is 16, expected 32"):
        stacked_matmul(x, (w,), jnp.int32(0), interpret=True, block_k=16)
    pair = quantize(rng.standard_normal((1, 2, 64, 2, 16)), "int8", pair=True)
    with pytest.raises(ValueError, match="merge_pair"):
        grouped_matmul(x, pair, jnp.asarray([4, 0], jnp.int32), layer=jnp.int32(0),
                       interpret=True)


def _abstract(shape, kind, **options):
    return jax.eval_shape(lambda: quantize(jnp.zeros(shape, jnp.bfloat16), kind, **options))


QWEN_FORMATS = {"fp8": dict(group_k=128, group_n=128), "int8": {}, "int4": dict(group_k=128)}
STORED = {"fp8": "f8E4M3FN", "int8": "i8", "int4": "ui8"}


@pytest.mark.parametrize("kind", QWEN_FORMATS)
def test_quantized_grouped_matmul_lowers_at_30b_shapes(kind):
    # Qwen3-30B-A3B's 48 layers of 128 experts, gate/up [D=2048, 2F=1536], in the MoE call
    # form: the quantised stacks are operands of the Triton call, read in place.
    shape = jax.ShapeDtypeStruct
    gate_up = _abstract((48, 128, 2048, 2, 768), kind, pair=True, **QWEN_FORMATS[kind])
    gate_up = jax.eval_shape(merge_pair, gate_up)
    plan = plan_groups(jnp.zeros((128,), jnp.int32), num_rows=64, block_m=16)
    moe = lambda x, w, plan, rows, layer: grouped_matmul(x, w, plan=plan, layer=layer,
                                                         lhs_rows=rows)
    for rows in (8, 2048):  # decode and prefill tiles
        lowered = lower_for_cuda(
            moe, shape((rows, 2048), jnp.bfloat16), gate_up,
            jax.tree.map(lambda a: shape(a.shape, a.dtype), plan), shape((64,), jnp.int32),
            shape((), jnp.int32))
        text = lowered.as_text()
        calls = [line for line in text.splitlines() if "xla.gpu.triton" in line]
        assert len(calls) == 1 and " while" not in text and "gather" not in text
        values = "1024" if kind == "int4" else "2048"
        assert f"tensor<48x128x{values}x1536x{STORED[kind]}>" in calls[0]


@pytest.mark.parametrize("kind", QWEN_FORMATS)
def test_quantized_stacked_matmul_lowers_at_30b_shapes(kind):
    shape = jax.ShapeDtypeStruct
    stacks = [_abstract((48, 2048, n), kind, **QWEN_FORMATS[kind]) for n in (4096, 512, 512)]
    lowered = lower_for_cuda(lambda x, ws, layer: stacked_matmul(x, ws, layer),
                             shape((8, 2048), jnp.bfloat16), stacks, shape((), jnp.int32))
    calls = [line for line in lowered.as_text().splitlines() if "xla.gpu.triton" in line]
    assert len(calls) == 1  # q, k and v in one launch
    values = "1024" if kind == "int4" else "2048"
    assert f"tensor<48x{values}x4096x{STORED[kind]}>" in calls[0]


def test_fp8_values_are_e4m3():
    q = quantize(np.ones((1, 32, 32), np.float32), "fp8", group_k=32, group_n=32)
    assert q.values.dtype == ml_dtypes.float8_e4m3fn
    assert float(np.asarray(q.values, np.float32).max()) == 448.0  # max |w| maps to e4m3 max
