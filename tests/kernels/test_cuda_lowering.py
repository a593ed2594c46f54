"""pallas_kernels.cuda_lowering and the GPU-interpreter helpers of
pallas_kernels.mosaic_support against the installed jax: the version-dependent and
private APIs they wrap behave as they say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.cuda_lowering import (
    H200,
    cuda_lowering_context,
    cuda_lowering_error,
    lower_for_cuda,
)
from pallas_kernels.mosaic_support import gpu_interpret_params, reset_gpu_interpreter

SPEC = jax.ShapeDtypeStruct((128,), jnp.float32)


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def _triton_double():
    return pl.pallas_call(_double, out_shape=SPEC,
                          compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1))


def test_triton_kernels_lower_for_cuda_through_the_helper():
    assert cuda_lowering_error() is None
    assert "xla.gpu.triton" in lower_for_cuda(_triton_double(), SPEC).as_text()


def test_without_the_abstract_h200_only_jax_0_10_lowers_triton_kernels():
    # From 0.11 Triton lowering asks for the target GPU (the local one, or the abstract
    # mesh's device): the reason the helper exists. 0.10 assumed compute capability 9.0.
    def lower():
        return jax.jit(_triton_double()).trace(SPEC).lower(lowering_platforms=("cuda",))

    if jax.__version_info__ >= (0, 11):
        with pytest.raises(RuntimeError, match="No supported GPU devices found"):
            lower()
    else:
        assert "xla.gpu.triton" in lower().as_text()


def test_mosaic_gpu_kernels_lower_for_cuda_in_and_out_of_the_context():
    kernel = plgpu.kernel(_double, out_type=SPEC)
    assert "@mosaic_gpu" in lower_for_cuda(kernel, SPEC).as_text()
    plain = jax.jit(kernel).trace(SPEC).lower(lowering_platforms=("cuda",))
    assert "@mosaic_gpu" in plain.as_text()


def test_the_context_keeps_the_mesh_axes_and_targets_an_h200():
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # 8 host devices (tests/conftest.py)
    with cuda_lowering_context(mesh):
        abstract = jax.sharding.get_abstract_mesh()
        assert abstract.axis_names == ("data", "model") and abstract.axis_sizes == (2, 4)
        assert abstract.abstract_device == H200
    with cuda_lowering_context():
        assert jax.sharding.get_abstract_mesh().axis_names == ()
    assert H200.device_kind == "NVIDIA H200" and H200.platform == "gpu"


def test_keyword_arguments_are_closed_over_as_static():
    text = lower_for_cuda(lambda x, *, times: x * times, SPEC, times=3.0).as_text()
    assert "3.000000e+00" in text and "%arg1" not in text  # one operand: x


def test_the_gpu_interpreter_runs_a_kernel_and_resets():
    params = gpu_interpret_params()
    assert type(params).__name__ == "InterpretGPUParams"
    kernel = plgpu.kernel(_double, out_type=SPEC, interpret=params)
    x = jnp.arange(128, dtype=jnp.float32)
    np.testing.assert_array_equal(kernel(x), 2 * x)
    reset_gpu_interpreter()  # the private entry point is where this jax keeps it
    np.testing.assert_array_equal(kernel(x + 1), 2 * x + 2)
