"""The jnp references against independent numpy oracles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import BF16, FP8, as_float, make_case, naive_attention
from pallas_kernels import grouped_matmul_reference, ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.reference import num_blocks_bound, rows_per_block

# Mixed batch: a decode at a page boundary, a short prefill, a full chunk, kv_len 1.
MIXED = [(1, 16), (3, 11), (16, 40), (1, 1)]


@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (8, 64)])
def test_attention_reference_matches_naive_loop(group, head_dim):
    case = make_case(MIXED, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     page_size=8, pages_per_seq=6, num_pad_seqs=1, num_pad_tokens=3)
    sm_scale = head_dim ** -0.5
    out = jax.jit(ragged_paged_attention_reference, static_argnames="sm_scale")(
        *case.args(), sm_scale=sm_scale)
    # fp32 end to end: only summation order differs from the float64 loop.
    np.testing.assert_allclose(out, naive_attention(case, sm_scale=sm_scale),
                               atol=2e-5, rtol=2e-5)
    assert not np.any(np.asarray(out)[case.query_start[case.num_seqs]:])


def test_attention_reference_long_prefill_is_blocked_and_exact():
    # 300 rows of one sequence: query blocks of 128 rows, the last one part full.
    case = make_case([(300, 310), (2, 9)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=16, pages_per_seq=20)
    out = ragged_paged_attention_reference(*case.args(), sm_scale=0.125)
    np.testing.assert_allclose(out, naive_attention(case, sm_scale=0.125),
                               atol=2e-5, rtol=2e-5)


def test_attention_reference_query_blocks_hold_one_sequence_each():
    # T / S >= 2: rows go in blocks of B > 1 rows of one sequence, each block gathering
    # its sequence's keys once; decode-only steps keep one row per block.
    assert rows_per_block(256, 16) == 16 and rows_per_block(48, 16) == 2
    assert rows_per_block(16, 16) == 1 and rows_per_block(8, 4) == 1
    assert num_blocks_bound(256, 16, 16) == 32 and num_blocks_bound(16, 16, 1) == 16
    # Chunks that do not fill their last block, decodes, padding sequences and rows.
    case = make_case([(37, 40), (1, 90), (9, 9), (1, 3), (70, 150)], num_q_heads=4,
                     num_kv_heads=2, head_dim=32, page_size=8, pages_per_seq=20,
                     num_pad_seqs=2, num_pad_tokens=5)
    out = jax.jit(ragged_paged_attention_reference, static_argnames="sm_scale")(
        *case.args(), sm_scale=0.125)
    np.testing.assert_allclose(out, naive_attention(case, sm_scale=0.125),
                               atol=2e-5, rtol=2e-5)
    assert not np.any(np.asarray(out)[case.query_start[case.num_seqs]:])


def test_attention_reference_many_blocks_run_in_groups():
    # 150 decodes: one row per block, more blocks than gather at once (lax.map groups).
    rng = np.random.default_rng(1)
    case = make_case([(1, int(k)) for k in rng.integers(1, 40, 150)], num_q_heads=4,
                     num_kv_heads=2, head_dim=32, page_size=8, pages_per_seq=5,
                     num_pad_seqs=3, num_pad_tokens=3)
    out = ragged_paged_attention_reference(*case.args(), sm_scale=0.125)
    np.testing.assert_allclose(out, naive_attention(case, sm_scale=0.125),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [np.int8, FP8])
def test_attention_reference_dequantises_with_per_head_scales(kv_dtype):
    case = make_case(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=8,
                     pages_per_seq=6, kv_dtype=kv_dtype)
    out = ragged_paged_attention_reference(*case.args(), sm_scale=0.125,
                                           k_scale=case.k_scale, v_scale=case.v_scale)
    np.testing.assert_allclose(out, naive_attention(case, sm_scale=0.125),
                               atol=2e-5, rtol=2e-5)


def test_attention_reference_bf16_and_all_padding():
    case = make_case(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=8,
                     pages_per_seq=6, dtype=BF16)
    out = ragged_paged_attention_reference(*case.args(), sm_scale=0.125)
    assert out.dtype == jnp.bfloat16
    # bf16 output rounding: ~3 significant digits on values of order 1.
    np.testing.assert_allclose(as_float(out), naive_attention(case, sm_scale=0.125),
                               atol=2e-2, rtol=2e-2)
    empty = ragged_paged_attention_reference(*case.args()[:-1], np.int32(0), sm_scale=0.1)
    assert not np.any(as_float(empty))


def test_grouped_matmul_reference_matches_numpy_per_group():
    rng = np.random.default_rng(0)
    group_sizes = np.array([3, 0, 5, 1], np.int32)
    lhs = rng.standard_normal((12, 16)).astype(np.float32)  # 3 trailing padding rows
    rhs = rng.standard_normal((4, 16, 8)).astype(np.float32)
    out = jax.jit(grouped_matmul_reference)(lhs, rhs, group_sizes)
    expected = np.zeros((12, 8), np.float64)
    starts = np.concatenate([[0], np.cumsum(group_sizes)])
    for g in range(4):
        rows = slice(starts[g], starts[g + 1])
        expected[rows] = lhs[rows].astype(np.float64) @ rhs[g]
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-5)
