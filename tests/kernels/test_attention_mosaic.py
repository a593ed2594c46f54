"""The Mosaic GPU prefill attention (ragged_paged_attention/mosaic.py) against the jnp
reference in the GPU interpreter (jax >= 0.11; on 0.10 every call runs the Triton
kernel, and these tests check that fallback instead), the calls it leaves to the Triton
kernel, and its CUDA lowering at Qwen3-30B-A3B shapes (no GPU needed).

Tolerance: bf16 2e-2, as in test_ragged_paged_attention.py (probabilities rounded to
bf16 before P @ V, bf16 output).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import BF16, FP8, as_float, make_case, passed_whole, record_tma_stores
from pallas_kernels import ragged_paged_attention_reference
from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.mosaic_support import attention_unsupported_reason
from pallas_kernels.ragged_paged_attention.mosaic import (
    mosaic_unsupported_reason,
    plan_attention_mosaic,
    ragged_paged_attention_mosaic,
)

MOSAIC = attention_unsupported_reason() is None  # jax >= 0.11
TOL = 2e-2


# (q_len, kv_len) per sequence, kv heads, query heads per kv head, head dim, page size,
# padding tokens: prefill chunks continuing a cached prefix (70 of 100, 33 of 80) beside
# one from scratch, a 64-row item boundary, a padding sequence and padding tokens; then
# GQA 4 at head dim 128 with 8-slot pages and fewer tokens than one 64-row item.
CASES = {
    "prefix_and_padding": ([(70, 100), (5, 5), (33, 80)], 2, 2, 64, 16, 3),
    "gqa4_small_pages": ([(30, 50), (11, 90)], 2, 4, 128, 8, 5),
}


def _case(name):
    seqs, num_kv_heads, group, head_dim, page_size, pad_tokens = CASES[name]
    pages_per_seq = -(-max(kv for _, kv in seqs) // page_size) + 1
    return make_case(seqs, num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq,
                     dtype=BF16, num_pad_seqs=1, num_pad_tokens=pad_tokens, seed=len(name))


def _plan(case):
    q, k_pages = case.q, case.k_pages
    return plan_attention_mosaic(jnp.asarray(case.query_start), jnp.asarray(case.kv_lens),
                                 jnp.asarray(case.num_seqs), num_tokens=q.shape[0],
                                 num_q_heads=q.shape[1], num_kv_heads=k_pages.shape[2],
                                 head_dim=q.shape[2])


def _kernels_in(*args, **kwargs):
    text = lower_for_cuda(ragged_paged_attention_mosaic, *args, **kwargs).as_text()
    return {"mosaic": "@mosaic_gpu" in text, "triton": "xla.gpu.triton" in text}


@pytest.mark.parametrize("name", CASES)
def test_matches_reference_in_the_gpu_interpreter(name):
    case = _case(name)
    sm_scale = case.q.shape[2] ** -0.5
    plan = _plan(case)
    reason = mosaic_unsupported_reason(case.q, case.k_pages, plan)
    if MOSAIC:
        assert reason is None
    else:  # jax 0.10: the same call runs the Triton kernel
        assert reason.startswith(f"jax {jax.__version__}") and "Triton runs" in reason
        assert _kernels_in(*case.args(), sm_scale=sm_scale) == {"mosaic": False,
                                                                "triton": True}
    out = ragged_paged_attention_mosaic(*case.args(), sm_scale=sm_scale, plan=plan,
                                        interpret=True)
    expected = jax.jit(ragged_paged_attention_reference, static_argnames="sm_scale")(
        *case.args(), sm_scale=sm_scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    np.testing.assert_allclose(as_float(out), as_float(expected), atol=TOL, rtol=TOL)
    assert not np.any(as_float(out)[int(case.query_start[-1]):]), "padding rows are zero"


def _qwen_args(num_tokens, num_seqs_max, page_dtype=jnp.bfloat16):
    # Qwen3-30B-A3B: 32 q / 4 kv heads of 128; 4,096 pages of 16 slots.
    shape = jax.ShapeDtypeStruct
    return (shape((num_tokens, 32, 128), jnp.bfloat16), shape((4096, 16, 4, 128), page_dtype),
            shape((4096, 16, 4, 128), page_dtype), shape((num_seqs_max,), jnp.int32),
            shape((num_seqs_max, 256), jnp.int32), shape((num_seqs_max + 1,), jnp.int32),
            shape((), jnp.int32))


def test_lowers_to_mosaic_gpu_at_qwen_prefill_shapes_reading_pages_in_place():
    text = lower_for_cuda(ragged_paged_attention_mosaic, *_qwen_args(2048, 64),
                          sm_scale=0.088).as_text()
    if not MOSAIC:  # jax 0.10: the Triton kernel
        assert "@mosaic_gpu" not in text and text.count("xla.gpu.triton(") == 1
        return
    calls = [line for line in text.splitlines() if "@mosaic_gpu" in line]
    assert len(calls) == 1 and "xla.gpu.triton" not in text
    pages = "tensor<4096x16x4x128xbf16>"
    assert calls[0].rsplit(" : (", 1)[1].count(pages) == 2  # keys and values, whole
    assert passed_whole(text, pages)  # never gathered, sliced or copied in XLA


def test_no_tma_store_is_larger_than_the_output(monkeypatch):
    # 40 query rows, fewer than one 64-row item: the ladder of row stores stops at 32.
    # (Shapes no other test traces: nothing is cached.)
    rows = record_tma_stores(monkeypatch)
    shape = jax.ShapeDtypeStruct
    args = (shape((40, 2, 64), jnp.bfloat16), shape((9, 16, 2, 64), jnp.bfloat16),
            shape((9, 16, 2, 64), jnp.bfloat16), shape((2,), jnp.int32),
            shape((2, 4), jnp.int32), shape((3,), jnp.int32), shape((), jnp.int32))
    lower_for_cuda(ragged_paged_attention_mosaic, *args, sm_scale=0.125)
    assert sorted(set(rows)) == ([1, 2, 4, 8, 16, 32] if MOSAIC else [])


@pytest.mark.parametrize("case, reason", [
    ("decode", "a decode step"),
    ("fp8_pages", "pages float8_e4m3fn"),
])
def test_other_calls_run_the_triton_kernel_and_say_why(case, reason):
    if case == "decode":  # 64 sequences, one token each
        args, kwargs = _qwen_args(64, 64), {}
    else:
        ones = jnp.ones((4,), jnp.float32)
        args, kwargs = _qwen_args(2048, 64, FP8), dict(k_scale=ones, v_scale=ones)
    q, k_pages, _, kv_lens, _, query_start, num_seqs = args
    plan = jax.eval_shape(lambda s, k, n: plan_attention_mosaic(
        s, k, n, num_tokens=q.shape[0], num_q_heads=32, num_kv_heads=4, head_dim=128),
        query_start, kv_lens, num_seqs)
    found = mosaic_unsupported_reason(q, k_pages, plan, **kwargs)
    assert (reason if MOSAIC else f"jax {jax.__version__}") in found
    assert _kernels_in(*args, sm_scale=0.088, **kwargs) == {"mosaic": False, "triton": True}
