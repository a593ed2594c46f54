"""The grouped matmul kernel against `jax.lax.ragged_dot`.

Tolerances: fp32 1e-4 relative to the row scale (fp32 accumulation in both, different
order); bf16 2e-2 (both accumulate in fp32, the output is rounded to bf16).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import BF16, INTERPRET, as_float
from pallas_kernels import grouped_matmul, grouped_matmul_reference

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
        lowered = jax.jit(grouped_matmul).trace(
            shape((8192, depth), jnp.bfloat16), shape((128, depth, width), jnp.bfloat16),
            shape((128,), jnp.int32)).lower(lowering_platforms=("cuda",))
        assert "xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("lhs_shape,rhs_shape,sizes_shape,blocks,match", [
    ((8, 32, 1), (2, 32, 16), (2,), {}, "lhs has shape"),
    ((8, 32), (2, 16, 16), (2,), {}, "rhs has shape"),
    ((8, 32), (2, 32, 16), (3,), {}, "group_sizes has shape"),
    ((8, 24), (2, 24, 16), (2,), {}, "lhs's K is 24"),
    ((8, 32), (2, 32, 16), (2,), {"block_n": 32}, "block_n is 32"),
    ((8, 32), (2, 32, 16), (2,), {"block_m": 12}, "block_m is 12"),
])
def test_bad_shapes_raise_value_error(lhs_shape, rhs_shape, sizes_shape, blocks, match):
    with pytest.raises(ValueError, match=match):
        grouped_matmul(np.zeros(lhs_shape, np.float32), np.zeros(rhs_shape, np.float32),
                       np.zeros(sizes_shape, np.int32), interpret=True, **blocks)
