"""XLA flags the tests set before jax starts (no jax import here: tests/conftest.py reads
this first)."""

import importlib.metadata


def compile_speed_flags() -> list[str]:
    """On jaxlib 0.10, XLA's CPU compiler with its element-wise fusion emitters in place
    of the MLIR ones. A test's time is mostly XLA compiling steps (3-6 s each for a tiny
    model on 2 cores); the older emitters compile the tiny engines' steps in 0.6-0.8x the
    time (benchmarks/step_compile.py). XLA fuses somewhat differently for them (fewer,
    larger fusions) and emits other code for each; the tiny engine's sampled tokens, their
    logprobs and prompt logprobs came out bit for bit the same both ways. jaxlib 0.11
    removed the switch, and XLA stops at a flag it does not know: only 0.10 gets it."""
    if importlib.metadata.version("jaxlib").startswith("0.10."):
        return ["--xla_cpu_use_fusion_emitters=false"]
    return []
