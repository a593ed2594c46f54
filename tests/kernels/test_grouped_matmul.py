"""The grouped matmul kernel against `jax.lax.ragged_dot`.

Tolerances: fp32 1e-4 relative to the row scale (fp32 accumulation in both, different
order); bf16 2e-2 (both accumulate in fp32, the output is rounded to bf16).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import BF16, INTERPRET, as_float
from pallas_kernels import grouped_matmul, grouped_matmul_reference, plan_groups
from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.grouped_matmul import group_ends_of
from pallas_kernels.grouped_matmul.plan import NO_ITEM, plan_width
from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla
from pallas_kernels.quantized import quantize

# Sizes chosen against 16-row tiles: empty groups, groups inside one tile, a group
# spanning several tiles, unaligned boundaries, and trailing rows past sum(sizes).
GROUP_SIZES = {
    "ragged": [5, 0, 37, 1, 0, 16, 3],
    "one_group": [0, 0, 64, 0],
    "all_empty": [0, 0, 0],
    "padded_tail": [7, 9, 2],
}


def _run(lhs, rhs, sizes, **blocks):
    out = grouped_matmul(lhs, rhs, sizes, interpret=INTERPRET, **blocks)
    expected = jax.jit(grouped_matmul_reference)(lhs, rhs, sizes)
    assert out.shape == expected.shape and out.dtype == lhs.dtype
    return as_float(out), as_float(expected)


@pytest.mark.parametrize("name", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_kernel_matches_ragged_dot(name, dtype):
    sizes = np.array(GROUP_SIZES[name], np.int32)
    rng = np.random.default_rng(len(name))
    lhs = rng.standard_normal((64, 32)).astype(dtype)
    rhs = rng.standard_normal((len(sizes), 32, 48)).astype(dtype)
    out, expected = _run(lhs, rhs, sizes, block_m=16, block_k=16, block_n=16)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    scale = np.sqrt(32)  # each entry is a sum of 32 unit-variance products
    np.testing.assert_allclose(out / scale, expected / scale, atol=tol, rtol=tol)
    assert not np.any(out[sizes.sum():]), "rows past sum(group_sizes) must be zero"


def test_tuned_blocks_on_a_moe_like_shape():
    # Top-2 routing of 48 tokens over 8 experts: the tuning table picks the blocks.
    rng = np.random.default_rng(1)
    sizes = np.bincount(rng.integers(0, 8, 96), minlength=8).astype(np.int32)
    lhs = rng.standard_normal((100, 64)).astype(BF16)
    rhs = (rng.standard_normal((8, 64, 96)) / 8).astype(BF16)
    out, expected = _run(lhs, rhs, sizes)
    np.testing.assert_allclose(out, expected, atol=2e-2, rtol=2e-2)


def test_lowers_to_triton_for_qwen_expert_shapes():
    # Qwen3-30B-A3B experts: 8k routed rows, hidden 2048, 2 x 768 gate/up; no GPU needed.
    shape = jax.ShapeDtypeStruct
    for depth, width in ((2048, 1536), (768, 2048)):
        lowered = lower_for_cuda(
            grouped_matmul, shape((8192, depth), jnp.bfloat16),
            shape((128, depth, width), jnp.bfloat16), shape((128,), jnp.int32))
        assert "xla.gpu.triton" in lowered.as_text()
    # The MoE form: stacked weights of all 48 layers, rows read and stored in place.
    moe = lambda x, w, plan, rows, layer: grouped_matmul(x, w, plan=plan, layer=layer,
                                                         lhs_rows=rows)
    plan = plan_groups(jnp.zeros((128,), jnp.int32), num_rows=64, block_m=16)
    lowered = lower_for_cuda(
        moe, shape((8, 2048), jnp.bfloat16), shape((48, 128, 2048, 1536), jnp.bfloat16),
        jax.tree.map(lambda a: shape(a.shape, a.dtype), plan), shape((64,), jnp.int32),
        shape((), jnp.int32))
    text = lowered.as_text()
    assert "xla.gpu.triton" in text and " while" not in text and "gather" not in text


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_moe_options_read_stacked_weights_and_rows_in_place(dtype):
    # The MoE call pattern: pairs sorted by expert read their token rows through
    # lhs_rows, results go back to pair order through out_rows, weights come from a
    # stacked [X, G, K, N] at a traced layer, one plan serves both calls.
    rng = np.random.default_rng(3)
    num_tokens, top_k, num_experts = 13, 2, 5
    x = rng.standard_normal((num_tokens, 32)).astype(dtype)
    rhs = rng.standard_normal((3, num_experts, 32, 48)).astype(dtype)
    ids = rng.integers(0, num_experts + 1, num_tokens * top_k)  # E: pairs not computed here
    order = np.argsort(ids, kind="stable").astype(np.int32)
    sizes = np.bincount(ids, minlength=num_experts + 1)[:num_experts].astype(np.int32)
    plan = plan_groups(group_ends_of(jnp.asarray(sizes), len(ids)), num_rows=len(ids),
                       block_m=16)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    for layer in (0, 2):
        kwargs = dict(layer=jnp.int32(layer), lhs_rows=order // top_k, out_rows=order)
        out = grouped_matmul(x, rhs, plan=plan, interpret=INTERPRET, **kwargs)
        expected = grouped_matmul_reference(x, rhs, jnp.asarray(sizes), **kwargs)
        # by hand: pair p (token p // k) multiplied by its expert's weights, or zero
        by_hand = np.zeros((len(ids), 48), np.float32)
        for p, e in enumerate(ids):
            if e < num_experts:
                by_hand[p] = x[p // top_k].astype(np.float32) @ rhs[layer, e].astype(np.float32)
        np.testing.assert_allclose(as_float(out), as_float(expected), atol=tol, rtol=tol)
        np.testing.assert_allclose(as_float(out) / 6, by_hand / 6, atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", range(4))
def test_plan_covers_every_row_for_skewed_groups(seed):
    # Groups from empty to all rows, boundaries anywhere: the items the plan bounds
    # (cdiv(M, bm) + min(G, M) + 1) always suffice.
    rng = np.random.default_rng(seed)
    num_groups, num_rows = 9, 40
    cuts = np.sort(rng.integers(0, num_rows + 1, num_groups))
    sizes = np.diff(np.concatenate([[0], cuts])).astype(np.int32)
    lhs = rng.standard_normal((num_rows, 16)).astype(np.float32)
    rhs = rng.standard_normal((num_groups, 16, 16)).astype(np.float32)
    out, expected = _run(lhs, rhs, sizes, block_m=16, block_k=16, block_n=16)
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-4)


# Group counts at and around powers of two: the kernel loads the plan's G + 1 cumulated
# counts as one power-of-two vector, which must stay inside the (padded) plan.
BOUNDARY_GROUPS = [1, 2, 3, 63, 64, 65, 127, 128, 129, 255, 256, 257]


@pytest.mark.parametrize("num_groups", BOUNDARY_GROUPS)
def test_group_counts_at_power_of_two_boundaries(num_groups):
    # 24 rows (fewer than G from 63 on, as at decode) over a few groups, one of them the
    # last; 8 rows past the groups' end stay zero.
    rng = np.random.default_rng(num_groups)
    sizes = np.zeros(num_groups, np.int32)
    picked = np.unique(np.append(rng.integers(0, num_groups, 2), num_groups - 1))
    sizes[picked] = rng.multinomial(16, np.ones(len(picked)) / len(picked))
    lhs = rng.standard_normal((24, 16)).astype(np.float32)
    rhs = rng.standard_normal((num_groups, 16, 16)).astype(np.float32)
    out, expected = _run(lhs, rhs, sizes, block_m=16, block_k=16, block_n=16)
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-4)
    assert not np.any(out[16:])
    plan = plan_groups(group_ends_of(jnp.asarray(sizes), 24), num_rows=24, block_m=16)
    width = plan_width(num_groups)
    assert plan.tiles_cum.shape == (width,) and width >= num_groups + 1
    assert np.all(np.asarray(plan.tiles_cum[num_groups + 1:]) == NO_ITEM)


def test_unpadded_plan_fails_to_trace_from_jax_0_12():
    # The plan layout before the padding (G + 1 entries): the kernel's vector load runs
    # past its end. jax 0.12 checks that bound while tracing; 0.10 and 0.11 skipped it
    # for a start of 0, so the kernel lowered for CUDA and read past the plan on the GPU
    # (their interpreter's slice fails instead). The padding is what keeps it inside.
    num_groups, num_rows = 128, 24
    lhs = jax.ShapeDtypeStruct((num_rows, 16), jnp.float32)
    rhs = jax.ShapeDtypeStruct((num_groups, 16, 16), jnp.float32)
    plan = plan_groups(jnp.full((num_groups,), 8, jnp.int32), num_rows=num_rows, block_m=16)
    old = dataclasses.replace(plan, tiles_cum=plan.tiles_cum[:num_groups + 1])
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), old)
    zeros = lambda a: np.zeros(a.shape, a.dtype)
    interpret = lambda: grouped_matmul(zeros(lhs), zeros(rhs), plan=old, interpret=True)
    if jax.__version_info__ >= (0, 12):
        with pytest.raises(ValueError, match="Out of bound slice: start=0, size=256"):
            lower_for_cuda(lambda x, w, p: grouped_matmul(x, w, plan=p), lhs, rhs, spec)
        with pytest.raises(ValueError, match="Out of bound slice: start=0, size=256"):
            interpret()
    else:
        text = lower_for_cuda(lambda x, w, p: grouped_matmul(x, w, plan=p), lhs, rhs,
                              spec).as_text()
        assert "xla.gpu.triton" in text
        with pytest.raises(TypeError, match="limit_indices"):
            interpret()


def test_plan_with_different_block_m_is_refused():
    plan = plan_groups(jnp.asarray([4, 8], jnp.int32), num_rows=8, block_m=16)
    with pytest.raises(ValueError, match="block_m is 32, expected the plan's 16"):
        grouped_matmul(np.zeros((8, 16), np.float32), np.zeros((2, 16, 16), np.float32),
                       plan=plan, block_m=32, interpret=True)
    with pytest.raises(ValueError, match="plan covers 8 rows, expected 4"):
        grouped_matmul(np.zeros((4, 16), np.float32), np.zeros((2, 16, 16), np.float32),
                       plan=plan, interpret=True)


@pytest.mark.parametrize("lhs_shape,rhs_shape,sizes_shape,blocks,match", [
    ((8, 32, 1), (2, 32, 16), (2,), {}, "lhs has shape"),
    ((8, 32), (2, 16, 16), (2,), {}, "rhs has shape"),
    ((8, 32), (2, 32, 16), (3,), {}, "group_sizes has shape"),
    ((8, 24), (2, 24, 16), (2,), {}, "lhs's K is 24"),
    ((8, 32), (2, 32, 16), (2,), {"block_n": 32}, "block_n is 32"),
    ((8, 32), (2, 32, 16), (2,), {"block_m": 12}, "block_m is 12"),
    ((8, 32), (2, 32, 16), (2,), {"layer": 0}, r"rhs has shape .* \[X, G, K, N\]"),
    ((8, 32), (2, 32, 16), (2,), {"lhs_rows": np.zeros((8, 1), np.int32)}, "lhs_rows has shape"),
    ((8, 32), (2, 32, 16), (2,), {"out_rows": np.zeros((5,), np.int32)},
     r"out_rows has shape \(5,\), expected \(8,\)"),
])
def test_bad_shapes_raise_value_error(lhs_shape, rhs_shape, sizes_shape, blocks, match):
    with pytest.raises(ValueError, match=match):
        grouped_matmul(np.zeros(lhs_shape, np.float32), np.zeros(rhs_shape, np.float32),
                       np.zeros(sizes_shape, np.int32), interpret=True, **blocks)


def test_tiles_per_case():
    # decode: 16-row tiles, narrow columns; a 2k prefill (128 rows per expert): 64-row
    # tiles (1.5x straddle work, where 128-row tiles would double it).
    from pallas_kernels.grouped_matmul import tuning
    decode = tuning.matmul_blocks(num_rows=64, num_groups=128, k=2048, n=1536)
    assert (decode.block_m, decode.block_n) == (16, 64)
    prefill = tuning.matmul_blocks(num_rows=16384, num_groups=128, k=2048, n=1536)
    assert prefill.block_m == 64
    assert tuning.block_m_for(num_rows=16384, num_groups=128) == prefill.block_m


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_xla_ragged_dot_candidate_matches_the_reference(dtype):
    # grouped_matmul_xla: the same arguments, through lax.ragged_dot over the layer's
    # [G, K, N] weights; the MoE form (rows gathered and scattered back, a traced layer,
    # a plan) and plain group sizes with padding rows past the groups.
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 5, 26)  # 13 tokens x top-2 over 4 experts; 4 is padding
    order = np.argsort(ids, kind="stable").astype(np.int32)
    sizes = jnp.asarray(np.bincount(ids, minlength=5)[:4], jnp.int32)
    x = rng.standard_normal((13, 24)).astype(dtype)  # K 24: XLA needs no 16-wide tiles
    rhs = rng.standard_normal((3, 4, 24, 40)).astype(dtype)
    plan = plan_groups(group_ends_of(sizes, 26), num_rows=26, block_m=16)
    kwargs = dict(layer=jnp.int32(1), lhs_rows=order // 2, out_rows=order)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    out = grouped_matmul_xla(x, rhs, plan=plan, interpret=True, block_n=64, **kwargs)
    expected = grouped_matmul_reference(x, rhs, sizes, **kwargs)
    assert out.shape == (26, 40) and out.dtype == x.dtype
    np.testing.assert_allclose(as_float(out) / 5, as_float(expected) / 5, atol=tol, rtol=tol)
    plain = grouped_matmul_xla(x, rhs[0], jnp.asarray([3, 0, 6, 2], jnp.int32))
    np.testing.assert_allclose(
        as_float(plain) / 5, as_float(grouped_matmul_reference(
            x, rhs[0], jnp.asarray([3, 0, 6, 2], jnp.int32))) / 5, atol=tol, rtol=tol)
    assert not np.any(as_float(plain)[11:]), "rows past the groups must be zero"


def test_xla_candidate_refuses_quantised_weights_naming_rhs():
    weight = quantize(jnp.ones((2, 32, 32), jnp.float32), "int8")
    with pytest.raises(ValueError, match="rhs is a int8 QuantizedWeight"):
        grouped_matmul_xla(jnp.ones((4, 32), jnp.bfloat16), weight, jnp.asarray([2, 2]))
    with pytest.raises(ValueError, match="rhs has dtype int32"):
        grouped_matmul_xla(jnp.ones((4, 32), jnp.bfloat16), jnp.ones((2, 32, 32), jnp.int32),
                           jnp.asarray([2, 2]))
