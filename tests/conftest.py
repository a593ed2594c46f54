"""Test-wide setup. XLA must see 8 host devices before jax is first imported (sharding
tests), and its CPU compiler is set to compile fast where the installed jaxlib lets us
(tests/helpers/xla_flags.py); float32 matmuls use full precision so parity tolerances mean
what they say."""

import os

from tests.helpers.xla_flags import compile_speed_flags

# Appended: a flag given on the command line's XLA_FLAGS comes first, ours after it.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=8",
                                    *compile_speed_flags()]).strip()
# CPU unless JAX_PLATFORMS says otherwise: CI has no GPU and the sharding tests want the 8
# simulated host devices. On a GPU machine `JAX_PLATFORMS=cuda` runs the kernels compiled
# (benchmarks/device_check.sh does); benchmarks/device_probe.py never goes through pytest.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

pytest_plugins = ["tests.helpers.no_skips", "pytester"]


import pytest  # noqa: E402

from serving.executor.shared_executables import SHARED  # noqa: E402


@pytest.fixture(autouse=True)
def _patched_traces_share_nothing(request):
    """A test that monkeypatches may change what a step traces to (a module's knob, the
    kernels): its engines neither take nor leave shared executables
    (serving/executor/shared_executables.py)."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    limit, SHARED.limit = SHARED.limit, 0
    SHARED.clear()
    try:
        yield
    finally:
        SHARED.limit = limit
