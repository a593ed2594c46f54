"""Grouped matmul for prefill-sized groups as a Mosaic GPU (Hopper: TMA + WGMMA) kernel.

The tiling is the Triton kernel's (plan.py): row tiles of `block_m` aligned to multiples
of block_m, a tile straddling a group boundary visited once per group it touches, and a
padding segment written as zeros. The plan's (group, tile) search runs in XLA here
(`work_items`, one [W, G+1] compare per call) instead of in every program. Each program
pipelines its [block_m, K] rows and its group's [K, block_n] weight columns through
shared memory with TMA (`emit_pipeline`) into a WGMMA accumulator, then stores only its
group's rows: TMA stores have static shapes, so a ladder of power-of-two row copies
stores any count (as upstream `ragged_dot_mgpu` does).

Weights are read in place from the whole stacked [X, G, K, N] array at `layer` (no
per-layer copy). TMA moves whole rows, so rows named by `lhs_rows` are gathered in XLA
first and `out_rows` is an XLA scatter after: an activation copy each, which prefill can
afford (the weights dominate) and decode cannot. So this kernel takes 16-bit float
operands and plans with block_m >= 64 (WGMMA's M is 64 per warpgroup); decode-sized
plans, fp32 (WGMMA reads fp32 only as TF32, and only with K-major weights) and quantised
weights run the Triton kernel (`mosaic_unsupported_reason` says which and why).

Where it runs: impl "mosaic", or a kernel table's "mosaic" entry, on a Hopper GPU; on a
CPU the GPU interpreter runs it on every supported jax (0.10.2: its private
interpreter), `emit_pipeline` included. Not yet measured on an H200.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul.kernel import check_grouped_matmul_args, grouped_matmul
from pallas_kernels.grouped_matmul.plan import GroupPlan, group_ends_of, plan_groups
from pallas_kernels.grouped_matmul.tuning import block_m_for
from pallas_kernels.mosaic_support import interpret_arg, store_rows
from pallas_kernels.quantized import QuantizedWeight

# Columns of the work-item table.
GROUP, TILE, START, END = range(4)
_BLOCK_K = 64     # 128 bytes of bf16: one swizzled TMA row
_BLOCK_N = 128
_STAGES = 3       # K steps in flight


def work_items(plan: GroupPlan):
    """int32[W, 4]: (group, tile start, first row, end row) of each work item; group G is
    the padding segment, unused items have no rows (the kernel's `_locate`, vectorised)."""
    num_groups, block_m = plan.num_groups, plan.block_m
    ids = jnp.arange(plan.num_items, dtype=jnp.int32)                      # [W]
    cum = plan.tiles_cum                                                   # [width]
    seg = jnp.sum((cum[None, :] <= ids[:, None]).astype(jnp.int32), axis=1)
    last = jnp.clip(seg - 1, 0, num_groups)
    before = jnp.where(seg > 0, cum[last], 0)
    start = jnp.where(seg > 0, plan.ends[jnp.minimum(last, num_groups - 1)], 0)
    end = jnp.where(seg < num_groups, plan.ends[jnp.minimum(seg, num_groups - 1)],
                    plan.num_rows)
    tile = (start // block_m + ids - before) * block_m
    first = jnp.maximum(start, tile)
    used = seg <= num_groups
    stop = jnp.minimum(end, tile + block_m)
    return jnp.stack([jnp.minimum(seg, num_groups), jnp.where(used, tile, 0),
                      jnp.where(used, first, 0), jnp.where(used, stop, 0)], axis=1)


def _mosaic_kernel(items_ref, layer_ref, lhs_ref, rhs_ref, out_ref, *, block_m, block_n,
                   block_k, num_groups):
    # items_ref: int32[W, 4]; layer_ref: int32[1]; lhs_ref: [M', K] (M' a multiple of
    # block_m); rhs_ref: [X, G, K, N]; out_ref: [M, N]
    item, col_block = lax.axis_index("item"), lax.axis_index("col")
    group = items_ref[item, GROUP]
    tile = pl.multiple_of(items_ref[item, TILE], block_m)
    first, end = items_ref[item, START], items_ref[item, END]
    depth = lhs_ref.shape[1]

    def matmul(acc_ref):
        plgpu.emit_pipeline(
            lambda _, lhs_smem, rhs_smem: plgpu.wgmma(acc_ref, lhs_smem, rhs_smem),
            grid=(depth // block_k,),
            in_specs=[plgpu.BlockSpec((block_m, block_k), lambda k: (0, k), delay_release=1),
                      plgpu.BlockSpec((block_k, block_n), lambda k: (k, col_block),
                                      delay_release=1)],
            # emit_pipeline shrinks this to the K steps (after checking delay_release)
            max_concurrent_steps=_STAGES,
        )(lhs_ref.at[pl.ds(tile, block_m)],
          rhs_ref.at[layer_ref[0], jnp.minimum(group, num_groups - 1)])
        return acc_ref[...]

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), out_ref.dtype))
    def _(o_smem):
        @pl.when(group < num_groups)
        def _():
            acc = pl.run_scoped(matmul, plgpu.ACC((block_m, block_n), jnp.float32))
            o_smem[...] = acc.astype(o_smem.dtype)

        @pl.when(group >= num_groups)  # the padding segment: zeros, no matmul
        def _():
            o_smem[...] = jnp.zeros((block_m, block_n), o_smem.dtype)

        plgpu.commit_smem()
        cols = pl.ds(col_block * block_n, block_n)
        store_rows(o_smem, lambda start, size: out_ref.at[pl.ds(start, size), cols],
                   smem_start=first - tile, gmem_start=first, num_rows=end - first,
                   max_rows=min(block_m, out_ref.shape[0]))


def mosaic_unsupported_reason(lhs, rhs, *, block_m, block_n=_BLOCK_N) -> str | None:
    """None when the Mosaic kernel takes this call, else why the Triton kernel runs."""
    if isinstance(rhs, QuantizedWeight):
        return f"{rhs.kind} weights: the Mosaic GPU kernel reads float weights only"
    if lhs.dtype not in (jnp.bfloat16, jnp.float16) or rhs.dtype != lhs.dtype:
        return (f"lhs {lhs.dtype}, rhs {rhs.dtype}: the Mosaic GPU kernel takes equal 16-bit "
                "floats (WGMMA reads fp32 only as TF32)")
    if block_m < 64:
        return f"block_m {block_m} (decode-sized groups): WGMMA tiles have 64 rows"
    if lhs.shape[1] % _BLOCK_K or rhs.shape[-1] % block_n:
        return (f"K {lhs.shape[1]}, N {rhs.shape[-1]}: expected multiples of {_BLOCK_K} "
                f"and block_n {block_n}")
    return None


def _grouped_matmul_mosaic(lhs, rhs, plan, layer, *, block_n, interpret):
    """The Mosaic GPU launch: lhs [M', K] with rows in plan order -> [M, N]."""
    rhs4 = rhs[None] if layer is None else rhs                             # [X, G, K, N]
    num_groups, width = rhs4.shape[1], rhs4.shape[-1]
    kernel = functools.partial(_mosaic_kernel, block_m=plan.block_m, block_n=block_n,
                               block_k=_BLOCK_K, num_groups=num_groups)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((plan.num_rows, width), lhs.dtype),
        grid=(plan.num_items, width // block_n), grid_names=("item", "col"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_arg(interpret),
    )(work_items(plan), layer_arr, lhs, rhs4)


@functools.partial(jax.jit, static_argnames=(
    "interpret", "block_m", "block_k", "block_n", "num_warps", "num_stages"))
def grouped_matmul_mosaic(lhs, rhs, group_sizes=None, *, plan: GroupPlan | None = None,
                          layer=None, lhs_rows=None, out_rows=None, interpret=False,
                          block_m=None, block_k=None, block_n=None, num_warps=None,
                          num_stages=None):
    """`grouped_matmul`'s contract and arguments, with prefill-sized groups in the Mosaic
    GPU kernel (block_m from the plan, 64 or more; block_n 64, 128 or 256); other calls
    (`mosaic_unsupported_reason`) run the Triton kernel, which alone reads block_k,
    num_warps and num_stages."""
    num_rows = check_grouped_matmul_args(lhs, rhs, group_sizes, layer=layer,
                                         lhs_rows=lhs_rows, out_rows=out_rows, plan=plan)
    if plan is not None:
        block_m = block_m or plan.block_m
    block_m = block_m or block_m_for(num_rows=num_rows, num_groups=rhs.shape[-3])
    reason = mosaic_unsupported_reason(lhs, rhs, block_m=block_m, block_n=block_n or _BLOCK_N)
    if reason is not None or (plan is not None and plan.block_m != block_m):
        return grouped_matmul(lhs, rhs, group_sizes, plan=plan, layer=layer,
                              lhs_rows=lhs_rows, out_rows=out_rows, interpret=interpret,
                              block_m=block_m, block_k=block_k, block_n=block_n,
                              num_warps=num_warps, num_stages=num_stages)
    if block_n is not None and block_n not in (64, 128, 256):
        raise ValueError(f"block_n is {block_n}, expected 64, 128 or 256 (Mosaic GPU tiles)")
    if plan is None:
        plan = plan_groups(group_ends_of(group_sizes, num_rows), num_rows=num_rows,
                           block_m=block_m)
    # TMA reads whole tiles: the rows, in plan order, padded to a multiple of block_m.
    padded = -(-num_rows // block_m) * block_m
    if lhs_rows is not None:
        rows = jnp.pad(lhs_rows.astype(jnp.int32), (0, padded - num_rows))
        lhs = lhs[rows]                                                    # [M', K]
    elif padded != num_rows:
        lhs = jnp.pad(lhs, ((0, padded - num_rows), (0, 0)))
    out = _grouped_matmul_mosaic(lhs, rhs, plan, layer, block_n=block_n or _BLOCK_N,
                                 interpret=interpret)                      # [M, N]
    if out_rows is not None:
        out = jnp.zeros_like(out).at[out_rows].set(out, unique_indices=True)
    return out
