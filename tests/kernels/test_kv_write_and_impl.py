"""Writing new K/V into page slots, and the impl switch."""

import jax
import numpy as np
import pytest

import pallas_kernels
from kernel_cases import FP8
from pallas_kernels import default_impl, ops, write_kv_pages


def test_write_kv_pages_puts_rows_in_their_slots_and_drops_negative_slots():
    rng = np.random.default_rng(0)
    k_pages = np.zeros((4, 8, 2, 16), np.float32)
    v_pages = np.zeros((4, 8, 2, 16), np.float32)
    k_new = rng.standard_normal((3, 2, 16)).astype(np.float32)
    v_new = rng.standard_normal((3, 2, 16)).astype(np.float32)
    slots = np.array([3 * 8 + 7, -1, 0 * 8 + 2], np.int32)  # page 3 slot 7, padding, page 0 slot 2
    k_out, v_out = jax.jit(write_kv_pages)(k_pages, v_pages, k_new, v_new, slots)
    np.testing.assert_array_equal(k_out[3, 7], k_new[0])
    np.testing.assert_array_equal(v_out[0, 2], v_new[2])
    assert np.count_nonzero(np.any(np.asarray(k_out) != 0, axis=(2, 3))) == 2


@pytest.mark.parametrize("dtype", [np.int8, FP8], ids=["int8", "fp8"])
def test_write_kv_pages_quantizes_with_per_head_scales(dtype):
    rng = np.random.default_rng(1)
    pages = np.zeros((2, 4, 2, 16), dtype)
    k_new = rng.uniform(-1, 1, (2, 2, 16)).astype(np.float32)
    scale = np.array([1 / 127, 2 / 127] if dtype == np.int8 else [0.5, 2.0], np.float32)
    k_out, _ = write_kv_pages(pages, pages, k_new, k_new, np.array([1, 6], np.int32),
                              k_scale=scale, v_scale=scale)
    restored = np.asarray(k_out).astype(np.float32) * scale[:, None]       # [P, L, K, H]
    if dtype == np.int8:  # round to nearest: within half a quantisation step
        atol, rtol = 0.5 * scale[:, None] + 1e-7, 0
    else:  # e4m3 keeps 3 mantissa bits: within 2^-4 relative (plus subnormals)
        atol, rtol = 1e-2 * scale[:, None], 2.0 ** -4
    assert np.all(np.abs(restored[0, 1] - k_new[0]) <= atol + rtol * np.abs(k_new[0]))
    assert np.all(np.abs(restored[1, 2] - k_new[1]) <= atol + rtol * np.abs(k_new[1]))


def test_write_kv_pages_rejects_mismatched_shapes():
    pages = np.zeros((2, 4, 2, 16), np.float32)
    with pytest.raises(ValueError, match="k_new/v_new have shapes"):
        write_kv_pages(pages, pages, np.zeros((3, 2, 8)), np.zeros((3, 2, 8)),
                       np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        write_kv_pages(pages, pages, np.zeros((3, 2, 16)), np.zeros((3, 2, 16)),
                       np.zeros((2,), np.int32))


def test_default_impl_is_pallas_only_on_gpu_backends():
    assert default_impl("gpu") == "pallas"
    assert default_impl("cpu") == "reference"
    assert default_impl() == ("pallas" if jax.default_backend() == "gpu" else "reference")


def test_ops_switches_every_entry_point():
    assert ops("pallas").ragged_paged_attention is pallas_kernels.ragged_paged_attention
    assert ops("reference").grouped_matmul is pallas_kernels.grouped_matmul_reference
    assert ops().impl == default_impl()
    with pytest.raises(ValueError, match="impl is 'triton'"):
        ops("triton")


def test_mosaic_impl_takes_the_mosaic_kernels_and_keeps_triton_for_the_rest():
    from pallas_kernels.grouped_matmul.mosaic import grouped_matmul_mosaic
    from pallas_kernels.ragged_paged_attention.mosaic import (
        plan_attention_mosaic,
        ragged_paged_attention_mosaic,
    )

    kernels = ops("mosaic")
    assert "mosaic" in pallas_kernels.IMPLS
    assert kernels.grouped_matmul is grouped_matmul_mosaic
    assert kernels.ragged_paged_attention is ragged_paged_attention_mosaic
    assert kernels.plan_attention is plan_attention_mosaic
    assert kernels.stacked_matmul is pallas_kernels.stacked_matmul
    run = pallas_kernels.interpreted(kernels).grouped_matmul
    assert run.func is grouped_matmul_mosaic and run.keywords == {"interpret": True}
