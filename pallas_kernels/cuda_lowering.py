"""Lowering kernels for CUDA on a machine without a GPU (CI, AOT checks of the step).

Triton-backed Pallas kernels ask for the target's compute capability while lowering.
jax 0.10 assumed 9.0 when no GPU was present; from 0.11 it reads it from the local GPU,
or from the abstract device of the current abstract mesh, so lowering inside
`use_abstract_mesh` with an H200 `AbstractDevice` works everywhere. The context is
harmless on 0.10 (it is ignored there) and Mosaic GPU kernels need none, so one context
serves every kernel and version. Only tracing and lowering belong inside it: an eager
jax call under an abstract mesh has no devices to run on.
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

# The GPU the engine targets (Hopper, compute capability 9.0).
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def cuda_lowering_context(mesh=None, *, device: AbstractDevice = H200):
    """Context manager: jit tracing and lowering inside it target `device`. `mesh` (a
    Mesh or AbstractMesh) gives the axes of the abstract mesh; None: no axes."""
    if mesh is None:
        return use_abstract_mesh(AbstractMesh((), (), abstract_device=device))
    return use_abstract_mesh(AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names),
                                          tuple(mesh.axis_types), abstract_device=device))


def lower_for_cuda(fn, *args, device: AbstractDevice = H200, **kwargs) -> jax.stages.Lowered:
    """`jax.jit(fn)` traced with `args` (arrays or ShapeDtypeStructs) and lowered for
    CUDA on any machine; keyword arguments are closed over (static)."""
    call = (lambda *a: fn(*a, **kwargs)) if kwargs else fn
    with cuda_lowering_context(device=device):
        return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))


def cuda_lowering_error() -> str | None:
    """None when a Triton kernel lowers for CUDA here through `lower_for_cuda`, else why
    not (type and message)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    spec = jax.ShapeDtypeStruct((16,), jax.numpy.float32)
    call = pl.pallas_call(copy, out_shape=spec,
                          compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1))
    try:
        lower_for_cuda(call, spec)
    except Exception as e:  # noqa: BLE001 - any failure means: cannot lower here
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


__all__ = ["H200", "cuda_lowering_context", "cuda_lowering_error", "lower_for_cuda"]
