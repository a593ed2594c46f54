"""Skip CUDA-lowering tests only where this jax cannot lower Triton kernels for CUDA on
this machine; never on jax 0.10.x, so CI (0.10.2, CPU only) always runs them."""

import functools

import jax
import pytest

from serving.executor.step_lowering import cuda_lowering_error as _lowering_error


@functools.cache
def cuda_lowering_error() -> str | None:
    """None when lowering for CUDA works here (always assumed on 0.10.x), else why not."""
    if jax.__version_info__ < (0, 11):
        return None
    return _lowering_error()


def requires_cuda_lowering(test):
    """Skips the test where this jax cannot lower Triton kernels for CUDA here."""
    error = cuda_lowering_error()
    return pytest.mark.skipif(error is not None,
                              reason=f"jax {jax.__version__} cannot lower for CUDA here: "
                                     f"{error}")(test)
