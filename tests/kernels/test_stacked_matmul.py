"""The stacked (layer-indexed) matmul kernel against its jnp reference.

Tolerances: fp32 1e-4 relative to the row scale (fp32 accumulation in both, different
order); bf16 2e-2 (both accumulate in fp32, the output is rounded to bf16).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import BF16, INTERPRET, as_float
from pallas_kernels import stacked_matmul, stacked_matmul_reference
from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.stacked_matmul import tuning


def _weights(rng, depth, widths, dtype, layers=3):
    return tuple(jnp.asarray(rng.standard_normal((layers, depth, n)) / np.sqrt(depth), dtype)
                 for n in widths)


def _compare(x, weights, layer, tol, **kwargs):
    out = stacked_matmul(x, weights, jnp.int32(layer), interpret=INTERPRET, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k == "out_dtype"}
    expected = stacked_matmul_reference(x, weights, jnp.int32(layer), **kwargs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_allclose(as_float(out), as_float(expected), atol=tol, rtol=tol)
    return as_float(out)


@pytest.mark.parametrize("rows,depth,widths", [
    (5, 32, (64,)),                # decode-sized rows, one weight
    (37, 48, (64, 16, 32)),        # q, k, v sharing one launch
    (70, 40, (24, 40)),            # K and N not multiples of 16 (dense MLP of test models)
], ids=["one", "qkv", "ragged-dims"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_kernel_matches_reference_at_every_layer(rows, depth, widths, dtype):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    weights = _weights(rng, depth, widths, dtype)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    outs = [_compare(x, weights, layer, tol, block_m=16, block_k=16, block_n=16)
            for layer in range(3)]
    assert not np.allclose(outs[0], outs[1]), "each layer reads its own weights"


def test_router_logits_in_float32_with_tuned_blocks():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((9, 64)), BF16)
    gate = _weights(rng, 64, (32,), BF16)
    out = _compare(x, gate, 2, 1e-5, out_dtype=jnp.float32)
    assert out.dtype == np.float32


def test_decode_blocks_spread_the_columns_over_many_programs():
    # Qwen3-30B-A3B's q/k/v at batch 8: 5,120 columns in 32-wide blocks = 160 programs.
    blocks = tuning.matmul_blocks(num_rows=8, k=2048, widths=[4096, 512, 512])
    assert (blocks.block_m, blocks.block_n) == (16, 32)
    prefill = tuning.matmul_blocks(num_rows=2048, k=2048, widths=[4096, 512, 512])
    assert (prefill.block_m, prefill.block_n) == (128, 128)


def test_lowers_to_triton_for_qwen_projection_shapes():
    shape = jax.ShapeDtypeStruct
    stacks = [shape((48, 2048, n), jnp.bfloat16) for n in (4096, 512, 512)]
    for rows in (8, 2048):
        lowered = lower_for_cuda(lambda x, q, k, v, layer: stacked_matmul(x, (q, k, v), layer),
                                 shape((rows, 2048), jnp.bfloat16), *stacks,
                                 shape((), jnp.int32))
        calls = [line for line in lowered.as_text().splitlines() if "xla.gpu.triton" in line]
        assert len(calls) == 1  # q, k and v in one launch
        operand_types = calls[0].rsplit(" : (", 1)[1].split(") -> ")[0]
        for n in (4096, 512):  # each whole stack is an operand of the call
            assert f"tensor<48x2048x{n}xbf16>" in operand_types


@pytest.mark.parametrize("args,match", [
    (dict(x=np.zeros((4, 32, 1))), "x has shape"),
    (dict(weights=()), "weights is empty"),
    (dict(weights=(np.zeros((3, 16, 16)),)), r"weights\[0\] has shape \(3, 16, 16\)"),
    (dict(weights=(np.zeros((3, 32, 16)), np.zeros((2, 32, 16)))), r"weights\[1\] has shape"),
    (dict(layer=np.zeros((2,), np.int32)), "layer has shape"),
    (dict(block_n=24), "block_n is 24"),
])
def test_bad_arguments_raise_value_error_naming_them(args, match):
    call = dict(x=np.zeros((4, 32), np.float32), weights=(np.zeros((3, 32, 16), np.float32),),
                layer=np.int32(0))
    blocks = {k: args.pop(k) for k in list(args) if k.startswith("block")}
    call.update(args)
    with pytest.raises(ValueError, match=match):
        stacked_matmul(call["x"], call["weights"], call["layer"], interpret=True, **blocks)
