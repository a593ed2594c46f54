"""The ragged paged attention kernel against its jnp reference.

Tolerances: fp32 inputs 1e-4 (only summation order differs: both accumulate in fp32,
the kernel online, the reference in one softmax); bf16 inputs 2e-2, from the kernel
rounding probabilities to bf16 before the P @ V matmul and bf16 output rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import BF16, FP8, INTERPRET, as_float, make_case
from pallas_kernels import (
    plan_attention,
    plan_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.ragged_paged_attention import tuning

PAGE = 16
# (q_len, kv_len): decodes at kv 1, a page boundary (16, 32) and one past it; a short
# prefill continuing a context; a full 32-row chunk from scratch; a long context.
MIXED = [(1, 1), (1, 32), (5, 21), (32, 32), (1, 17), (3, 150)]
DECODE = [(1, 1), (1, 16), (1, 17), (1, 100)]
CHUNKS = [(32, 48), (32, 96)]
TOLERANCE = {np.float32: 1e-4, BF16: 2e-2}


def _compare(case, *, sm_scale, tol, **blocks):
    out = ragged_paged_attention(*case.args(), sm_scale=sm_scale, k_scale=case.k_scale,
                                 v_scale=case.v_scale, interpret=INTERPRET, **blocks)
    expected = jax.jit(ragged_paged_attention_reference, static_argnames="sm_scale")(
        *case.args(), sm_scale=sm_scale, k_scale=case.k_scale, v_scale=case.v_scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    np.testing.assert_allclose(as_float(out), as_float(expected), atol=tol, rtol=tol)
    return as_float(out)


@pytest.mark.parametrize("seqs,group,head_dim,dtype", [
    (MIXED, 1, 64, np.float32),
    (MIXED, 4, 128, BF16),
    (MIXED, 8, 64, BF16),
    (MIXED, 8, 128, np.float32),
    (DECODE, 1, 128, BF16),
    (DECODE, 4, 64, np.float32),
    (DECODE, 8, 128, BF16),
    (CHUNKS, 4, 64, BF16),
    (CHUNKS, 8, 128, np.float32),
], ids=lambda v: v if isinstance(v, (int, str)) else None)
def test_kernel_matches_reference(seqs, group, head_dim, dtype):
    num_pages = -(-max(kv for _, kv in seqs) // PAGE)
    case = make_case(seqs, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     page_size=PAGE, pages_per_seq=num_pages + 1, dtype=dtype)
    _compare(case, sm_scale=head_dim ** -0.5, tol=TOLERANCE[dtype])


def test_padding_rows_and_sequences_are_zero():
    case = make_case(MIXED[:3], num_q_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=PAGE, pages_per_seq=3, num_pad_seqs=2, num_pad_tokens=19)
    out = _compare(case, sm_scale=0.125, tol=1e-4)
    assert not np.any(out[case.query_start[case.num_seqs]:])
    assert np.all(np.any(out[:case.query_start[case.num_seqs]], axis=(1, 2)))


def test_all_padding_gives_zeros():
    case = make_case(MIXED[:3], num_q_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=PAGE, pages_per_seq=3, num_pad_tokens=4)
    out = ragged_paged_attention(*case.args()[:-1], np.int32(0), sm_scale=0.125,
                                 interpret=INTERPRET)
    assert not np.any(as_float(out))


@pytest.mark.parametrize("kv_dtype", [np.int8, FP8], ids=["int8", "fp8"])
def test_quantized_pages_with_per_head_scales(kv_dtype):
    case = make_case(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=PAGE,
                     pages_per_seq=10, dtype=BF16, kv_dtype=kv_dtype)
    _compare(case, sm_scale=0.125, tol=2e-2)


def test_group_not_a_power_of_two_and_explicit_blocks():
    # 3 query heads per kv head are padded to 4 inside the wrapper.
    case = make_case(MIXED, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=8,
                     pages_per_seq=19)
    _compare(case, sm_scale=0.125, tol=1e-4, block_q=4, block_k=32)


# Few decoding sequences, contexts from 1 key to 13 pages: splits of whole key blocks,
# some of them empty, plus a padding sequence and padding rows.
FEW_DECODES = [(1, 1), (1, 200), (1, 65), (1, 130)]


@pytest.mark.parametrize("num_splits,kv_dtype", [(2, None), (16, None), (4, FP8)],
                         ids=["2-bf16", "16-bf16", "4-fp8"])
def test_flash_decoding_splits_match_reference(num_splits, kv_dtype):
    case = make_case(FEW_DECODES, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=PAGE,
                     pages_per_seq=13, dtype=BF16, kv_dtype=kv_dtype, num_pad_seqs=1,
                     num_pad_tokens=3)
    out = _compare(case, sm_scale=0.125, tol=2e-2, num_splits=num_splits, block_k=32)
    assert not np.any(out[int(case.query_start[case.num_seqs]):])


def test_decode_steps_of_few_sequences_split_and_others_do_not():
    # batch 1 runs in the (8 tokens, 4 sequences) bucket: 4 kv heads x 16 splits.
    assert tuning.decode_splits(num_tokens=8, num_seqs_max=4, num_kv_heads=4) == 16
    assert tuning.decode_splits(num_tokens=16, num_seqs_max=16, num_kv_heads=4) == 4
    assert tuning.decode_splits(num_tokens=64, num_seqs_max=64, num_kv_heads=4) == 1
    assert tuning.decode_splits(num_tokens=2048, num_seqs_max=4, num_kv_heads=4) == 1


def test_one_plan_serves_every_call_of_a_step():
    case = make_case(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=PAGE,
                     pages_per_seq=10)
    num_tokens = case.q.shape[0]
    plan = plan_attention(case.query_start, case.kv_lens, case.num_seqs, num_tokens=num_tokens,
                          num_q_heads=8, num_kv_heads=2, head_dim=64)
    planned = ragged_paged_attention(*case.args(), sm_scale=0.125, plan=plan,
                                     interpret=INTERPRET)
    unplanned = ragged_paged_attention(*case.args(), sm_scale=0.125, interpret=INTERPRET)
    np.testing.assert_array_equal(as_float(planned), as_float(unplanned))
    ref_plan = plan_attention_reference(case.query_start, case.kv_lens, case.num_seqs,
                                        num_tokens=num_tokens)
    reference = ragged_paged_attention_reference(*case.args(), sm_scale=0.125, plan=ref_plan)
    np.testing.assert_allclose(as_float(planned), as_float(reference), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=f"block_q is 64, expected the plan's {plan.block_q}"):
        ragged_paged_attention(*case.args(), sm_scale=0.125, plan=plan, block_q=64,
                               interpret=True)


@pytest.mark.parametrize("num_q_heads", [32, 64], ids=["30b-a3b", "235b-a22b"])
@pytest.mark.parametrize("page_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_jits_with_traced_num_seqs_and_lowers_to_triton_for_qwen_shapes(num_q_heads,
                                                                        page_dtype):
    # Qwen3-30B-A3B / 235B-A22B: 32 / 64 q heads (groups 8 / 16), 4 kv heads, head dim 128;
    # bf16 or fp8 pages (with per-head scales). Lowering needs no GPU.
    f32 = jax.ShapeDtypeStruct
    scales = (dict(k_scale=jnp.ones(4, jnp.float32), v_scale=jnp.ones(4, jnp.float32))
              if page_dtype == jnp.float8_e4m3fn else {})
    # decode at 64 sequences; batch-1 decode (split + combine: 2 calls); a prefill chunk.
    for num_tokens, num_seqs_max, calls in ((64, 64, 1), (8, 4, 2), (512, 4, 1)):
        args = (f32((num_tokens, num_q_heads, 128), jnp.bfloat16),
                f32((512, 16, 4, 128), page_dtype), f32((512, 16, 4, 128), page_dtype),
                f32((num_seqs_max,), jnp.int32), f32((num_seqs_max, 128), jnp.int32),
                f32((num_seqs_max + 1,), jnp.int32), f32((), jnp.int32))
        lowered = lower_for_cuda(ragged_paged_attention, *args, sm_scale=0.088, **scales)
        text = lowered.as_text()
        assert text.count("xla.gpu.triton(") == calls
        assert "stablehlo.while" not in text  # the plan's search compares, it does not loop


@pytest.mark.parametrize("change,match", [
    (dict(q=np.zeros((4, 8, 64, 1), np.float32)), "q has shape"),
    (dict(q=np.zeros((4, 7, 64), np.float32)), "divisible by k_pages' 2 kv heads"),
    (dict(q=np.zeros((4, 8, 48), np.float32)), "k_pages has shape"),
    (dict(v_pages=np.zeros((9, 8, 2, 32), np.float32)), "v_pages has shape"),
    (dict(page_table=np.zeros((3, 2), np.int32)), "page_table has shape"),
    (dict(query_start=np.zeros((2,), np.int32)), r"query_start has shape \(2,\)"),
    (dict(kv_lens=np.zeros((2, 1), np.int32)), "kv_lens has shape"),
    (dict(k_scale=np.ones((3,), np.float32)), r"k_scale has shape \(3,\)"),
    (dict(block_q=3), "block_q is 3"),
    (dict(block_k=8), "block_k is 8"),
])
def test_bad_shapes_raise_value_error_naming_the_argument(change, match):
    args = dict(q=np.zeros((4, 8, 64), np.float32),
                k_pages=np.zeros((9, 8, 2, 64), np.float32),
                v_pages=np.zeros((9, 8, 2, 64), np.float32),
                kv_lens=np.zeros((2,), np.int32), page_table=np.zeros((2, 4), np.int32),
                query_start=np.zeros((3,), np.int32), num_seqs=np.int32(2),
                sm_scale=0.1, interpret=True)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(**args)


def test_quantized_pages_without_scales_raise():
    pages = np.zeros((9, 8, 2, 64), np.int8)
    with pytest.raises(ValueError, match="k_scale is required"):
        ragged_paged_attention(np.zeros((4, 8, 64), np.float32), pages, pages,
                               np.zeros((2,), np.int32), np.zeros((2, 4), np.int32),
                               np.zeros((3,), np.int32), np.int32(2), sm_scale=0.1)


def test_slots_outside_every_context_are_never_read():
    # NaN everywhere a sequence may not look (unused pages, slots past kv_len): one read
    # of them would turn the output NaN.
    case = make_case(MIXED[:4], num_q_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=PAGE, pages_per_seq=3, num_pad_seqs=1, num_pad_tokens=2)
    visible = np.zeros(case.k_pages.shape[:2], bool)                      # [P, L]
    for s in range(int(case.num_seqs)):
        for p in range(case.kv_lens[s]):
            visible[case.page_table[s, p // PAGE], p % PAGE] = True
    for pages in (case.k_pages, case.v_pages):
        pages[~visible] = np.nan
    out = _compare(case, sm_scale=0.125, tol=1e-4)
    assert np.all(np.isfinite(out))
