"""The Mosaic GPU grouped matmul (grouped_matmul/mosaic.py) against `jax.lax.ragged_dot`
in the GPU interpreter, the calls it leaves to the Triton kernel, and its CUDA lowering
at Qwen3-30B-A3B prefill shapes (no GPU needed).

Tolerance: bf16 2e-2 relative to the row scale, as in test_grouped_matmul.py (both
accumulate in fp32; the output is rounded to bf16).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import as_float, passed_whole, record_tma_stores
from pallas_kernels import grouped_matmul_reference, plan_groups
from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.grouped_matmul import group_ends_of, tuning
from pallas_kernels.grouped_matmul.mosaic import grouped_matmul_mosaic, mosaic_unsupported_reason
from pallas_kernels.quantized import quantize

TOL = 2e-2


# (group sizes, rows, K, block_n) at 64-row tiles: empty groups, groups straddling tiles
# and inside one, padding rows past the groups, two column blocks; K of one pipeline step;
# fewer rows than one tile (the store ladder is bounded by the output's rows).
SWEEP = {
    "ragged": ([70, 0, 10, 30, 0], 128, 128, 64),
    "one_k_step": ([0, 64, 1], 80, 64, 128),
    "rows_below_a_tile": ([10, 0, 9], 26, 128, 128),
}


def _close(out, expected, depth):
    scale = np.sqrt(depth)  # each entry is a sum of `depth` unit-variance products
    np.testing.assert_allclose(as_float(out) / scale, as_float(expected) / scale, atol=TOL,
                               rtol=TOL)


@pytest.mark.parametrize("name", SWEEP)
def test_matches_ragged_dot_in_the_gpu_interpreter(name):
    sizes, num_rows, depth, block_n = SWEEP[name]
    sizes = jnp.asarray(sizes, jnp.int32)
    rng = np.random.default_rng(len(name))
    lhs = jnp.asarray(rng.standard_normal((num_rows, depth)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), depth, 128)), jnp.bfloat16)
    assert mosaic_unsupported_reason(lhs, rhs, block_m=64, block_n=block_n) is None
    out = grouped_matmul_mosaic(lhs, rhs, sizes, block_m=64, block_n=block_n, interpret=True)
    assert out.shape == (num_rows, 128) and out.dtype == jnp.bfloat16
    _close(out, grouped_matmul_reference(lhs, rhs, sizes), depth)
    assert not np.any(as_float(out)[int(sizes.sum()):]), "rows past the groups must be zero"


def test_moe_form_gathers_rows_scatters_them_back_and_reads_the_layer():
    # Pairs sorted by expert read their token through lhs_rows and are stored back in pair
    # order through out_rows; weights from a stacked [X, G, K, N] at a traced layer;
    # pairs routed to expert E (past every group) are the padding segment.
    rng = np.random.default_rng(7)
    num_tokens, top_k, num_experts, depth = 40, 2, 5, 128
    x = jnp.asarray(rng.standard_normal((num_tokens, depth)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, num_experts, depth, 128)), jnp.bfloat16)
    ids = rng.integers(0, num_experts + 1, num_tokens * top_k)
    order = np.argsort(ids, kind="stable").astype(np.int32)
    sizes = jnp.asarray(np.bincount(ids, minlength=num_experts + 1)[:num_experts], jnp.int32)
    plan = plan_groups(group_ends_of(sizes, len(ids)), num_rows=len(ids), block_m=64)
    kwargs = dict(layer=jnp.int32(2), lhs_rows=jnp.asarray(order // top_k),
                  out_rows=jnp.asarray(order))
    out = grouped_matmul_mosaic(x, rhs, plan=plan, interpret=True, **kwargs)
    _close(out, grouped_matmul_reference(x, rhs, sizes, **kwargs), depth)
    padding = np.flatnonzero(ids == num_experts)
    assert len(padding) and not np.any(as_float(out)[padding])


def test_no_tma_store_is_larger_than_the_output(monkeypatch):
    # TMA copies have static shapes, so a tile's rows are stored by a ladder of
    # power-of-two copies; with 24 output rows (below one 64-row tile) a 64- or 32-row
    # copy would overrun the output. (Shapes no other test traces: nothing is cached.)
    rows = record_tma_stores(monkeypatch)
    shape = jax.ShapeDtypeStruct
    lower_for_cuda(lambda x, w, sizes: grouped_matmul_mosaic(x, w, sizes, block_m=64,
                                                             block_n=64),
                   shape((24, 64), jnp.bfloat16), shape((3, 64, 64), jnp.bfloat16),
                   shape((3,), jnp.int32))
    assert sorted(set(rows)) == [1, 2, 4, 8, 16]


def _kernels_in(fn, *args):
    text = lower_for_cuda(fn, *args).as_text()
    return {"mosaic": "@mosaic_gpu" in text, "triton": "xla.gpu.triton" in text}


@pytest.mark.parametrize("case, reason", [
    ("fp32", "lhs float32, rhs float32"),
    ("int8", "int8 weights"),
    ("decode_plan", "block_m 16"),
])
def test_other_calls_run_the_triton_kernel_and_say_why(case, reason):
    shape = jax.ShapeDtypeStruct
    dtype = jnp.float32 if case == "fp32" else jnp.bfloat16
    lhs = shape((256, 128), dtype)
    rhs = shape((4, 128, 128), dtype)
    if case == "int8":
        rhs = jax.eval_shape(lambda w: quantize(w, "int8"), rhs)
    block_m = 16 if case == "decode_plan" else 64
    assert reason in mosaic_unsupported_reason(lhs, rhs, block_m=block_m)
    call = lambda x, w, sizes: grouped_matmul_mosaic(x, w, sizes, block_m=block_m)
    assert _kernels_in(call, lhs, rhs, shape((4,), jnp.int32)) == {"mosaic": False,
                                                                   "triton": True}


@pytest.mark.parametrize("depth, width", [(2048, 1536), (768, 2048)], ids=["gate_up", "down"])
def test_lowers_to_mosaic_gpu_at_qwen_prefill_shapes_reading_weights_in_place(depth, width):
    # Qwen3-30B-A3B: a 2,048-token prefill chunk routed top-8 over 128 experts (16,384
    # rows), the MoE call form over all 48 layers' stacked experts.
    shape = jax.ShapeDtypeStruct
    rows = 2048 * 8
    block_m = tuning.block_m_for(num_rows=rows, num_groups=128)
    plan = plan_groups(jnp.zeros((128,), jnp.int32), num_rows=rows, block_m=block_m)
    moe = lambda x, w, plan, order, layer: grouped_matmul_mosaic(
        x, w, plan=plan, layer=layer, lhs_rows=order // 8, out_rows=order)
    stack = f"tensor<48x128x{depth}x{width}xbf16>"
    text = lower_for_cuda(moe, shape((2048, depth), jnp.bfloat16),
                          shape((48, 128, depth, width), jnp.bfloat16),
                          jax.tree.map(lambda a: shape(a.shape, a.dtype), plan),
                          shape((rows,), jnp.int32), shape((), jnp.int32)).as_text()
    calls = [line for line in text.splitlines() if "@mosaic_gpu" in line]
    assert len(calls) == 1 and "xla.gpu.triton" not in text
    assert stack in calls[0].rsplit(" : (", 1)[1]  # the whole stack is the kernel's operand
    assert passed_whole(text, stack)
    # No layer's experts are sliced out (a copy of 128 x K x N weights per call).
    assert f"tensor<128x{depth}x{width}xbf16>" not in text
    assert f"tensor<1x128x{depth}x{width}xbf16>" not in text
