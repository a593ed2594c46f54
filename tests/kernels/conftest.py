"""Kernel tests' shared fixture: the Mosaic GPU interpreter's simulated state cleared after
each test (a kernel that failed under it leaves its state behind)."""

import pytest

from pallas_kernels.mosaic_support import reset_gpu_interpreter


@pytest.fixture(autouse=True)
def _fresh_gpu_interpreter():
    yield
    reset_gpu_interpreter()
