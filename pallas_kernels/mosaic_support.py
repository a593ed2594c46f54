"""What the Mosaic GPU kernels need from jax, in one place, for every supported version.

Mosaic GPU kernels (`plgpu.kernel`: TMA copies, barriers, WGMMA) run on a CPU only under
the GPU interpreter, which simulates shared memory, barriers and TMA. It is public from
jax 0.11.2 (`plgpu.InterpretGPUParams`) and private on 0.10 (same class in
`jax._src.pallas.mosaic_gpu.interpret`); resetting its state after a failed kernel is
private on every version. The grouped matmul kernel (TMA, barriers, `emit_pipeline`,
WGMMA) runs under it on 0.10.2, 0.11.2 and 0.12. The 0.10 interpreter lacks transposed
SMEM operands and layout casts (no `layout_cast` rule), which the attention kernel
needs, so Mosaic GPU attention is offered from jax 0.11 only
(`attention_unsupported_reason`); on 0.10 the Triton kernel runs. Mosaic GPU kernels
lower for CUDA on a CPU on every version without any context (tests/kernels/
test_cuda_lowering.py holds these facts against the installed jax).
"""

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def gpu_interpret_params():
    """A fresh `InterpretGPUParams()`: pass it as a `plgpu.kernel`'s `interpret`."""
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    except ImportError:  # jax 0.10: the interpreter is private
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def reset_gpu_interpreter() -> None:
    """Clears the interpreter's simulated memory; needed after a kernel raised under it,
    before the next interpreted kernel of the process."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.reset_gpu_interpret_mode_state()


def interpret_arg(interpret: bool):
    """The `interpret` argument of `plgpu.kernel`: the GPU interpreter, or None (compile)."""
    return gpu_interpret_params() if interpret else None


def attention_unsupported_reason() -> str | None:
    """None where the Mosaic GPU attention kernel is offered (jax >= 0.11), else why not."""
    if jax.__version_info__ < (0, 11):
        return (f"jax {jax.__version__}: its Mosaic GPU interpreter has no transposed SMEM "
                "operands or layout casts, so the kernel cannot be checked; Triton runs")
    return None


def store_rows(o_smem, dst, *, smem_start, gmem_start, num_rows, max_rows):
    """Copies rows [smem_start, smem_start + num_rows) of o_smem to `dst(start, size)` (the
    GMEM ref slice of `size` rows from `start`), from row gmem_start on. TMA copies have
    static shapes: one copy per set bit of num_rows, as upstream `ragged_dot_mgpu` stores
    its ragged tiles. `max_rows` (static) bounds num_rows: at most o_smem's rows and the
    GMEM ref's, so no copy is ever larger than either ref."""
    offset = 0
    size = 1 << (max_rows.bit_length() - 1)       # the largest power of two <= max_rows
    while size:
        @pl.when(num_rows & size != 0)
        def _(size=size, offset=offset):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(smem_start + offset, size)],
                                    dst(gmem_start + offset, size))

        offset = offset + (num_rows & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
