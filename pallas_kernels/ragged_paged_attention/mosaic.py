"""The prefill part of ragged paged attention as a Mosaic GPU (Hopper: TMA + WGMMA) kernel.

One program per (work item, query head): an item is at most 64 query rows of one
sequence (the plan's items at block_q 64, one WGMMA M tile), as upstream
`attention_mgpu` gives each head its own tile rather than packing a GQA group into the
rows. Per 64-key block the program TMA-copies the block's pages of its kv head
([L, H] slabs through the page table) into shared memory, computes Q K^T with WGMMA,
runs the online softmax in fp32 registers, and accumulates P V with a second WGMMA. The
item's rows are stored with a ladder of static-size TMA copies (`store_rows`).

Decode steps (flash-decoding splits, few query rows per sequence), fp8/int8 pages and
fp32 run the Triton kernel (`mosaic_unsupported_reason`): decode is bound by reading the
cache, where 64-row WGMMA tiles would be mostly empty. The GPU interpreter has no
register operand for WGMMA, so P goes through shared memory; keys are read without
double buffering. Both are first-version choices, to be measured on an H200.

Where it runs: prefill steps of impl "mosaic" (or a kernel table's "mosaic" entry) on a
Hopper GPU with jax >= 0.11; on a CPU the GPU interpreter runs it from jax 0.11 on. On
jax 0.10 the Triton kernel runs instead (`attention_unsupported_reason`): its
interpreter has no `layout_cast`, so the kernel could not be checked there.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_support import (
    attention_unsupported_reason,
    interpret_arg,
    store_rows,
)
from pallas_kernels.ragged_paged_attention import tuning
from pallas_kernels.ragged_paged_attention.attend import MASK_VALUE
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.plan import (
    POS_OFFSET,
    ROW_END,
    ROW_START,
    SEQ,
    AttentionPlan,
    plan_attention,
)
from pallas_kernels.ragged_paged_attention.shapes import check_attention_args

BLOCK_Q = 64   # query rows per program: one WGMMA tile
BLOCK_K = 64   # keys per step: 128 bytes of bf16 per row of P
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MosaicAttentionPlan:
    """The Triton kernel's plan, and for prefill steps the items at BLOCK_Q rows."""

    triton: AttentionPlan
    prefill: AttentionPlan | None


def plan_attention_mosaic(query_start, kv_lens, num_seqs, *, num_tokens, num_q_heads,
                          num_kv_heads, head_dim, block_q=None, num_splits=None
                          ) -> MosaicAttentionPlan:
    """`plan_attention`'s arguments; prefill steps also get items for the Mosaic kernel."""
    args = (query_start, kv_lens, num_seqs)
    dims = dict(num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim)
    triton = plan_attention(*args, **dims, block_q=block_q, num_splits=num_splits)
    kind = tuning.step_kind(num_tokens=num_tokens, num_seqs_max=kv_lens.shape[0])
    prefill = (plan_attention(*args, **dims, block_q=BLOCK_Q, num_splits=1)
               if kind == "prefill" else None)
    return MosaicAttentionPlan(triton=triton, prefill=prefill)


def _load_key_block(page_table_ref, k_pages_ref, v_pages_ref, k_smem, v_smem, barriers, *,
                    seq, kv_head, block):
    """TMA-copies keys and values [block * BLOCK_K, +BLOCK_K) of `seq` into k_smem and
    v_smem ([BLOCK_K, H] each), one page at a time; page ids past the table are clamped
    (their keys are masked)."""
    page_size, table_width = k_pages_ref.shape[1], page_table_ref.shape[1]
    num_pages = BLOCK_K // page_size
    for j in range(num_pages):
        page = page_table_ref[seq, jnp.minimum(block * num_pages + j, table_width - 1)]
        rows = pl.ds(j * page_size, page_size)
        plgpu.copy_gmem_to_smem(k_pages_ref.at[page, :, kv_head], k_smem.at[rows],
                                barriers.at[2 * j])
        plgpu.copy_gmem_to_smem(v_pages_ref.at[page, :, kv_head], v_smem.at[rows],
                                barriers.at[2 * j + 1])
    for j in range(2 * num_pages):
        plgpu.barrier_wait(barriers.at[j])


def _matmul(a_smem, b_smem, shape):
    """f32 a @ b through a WGMMA accumulator of `shape` (b may be a transposed view)."""
    def body(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _attention_kernel(items_ref, page_table_ref, q_ref, k_pages_ref, v_pages_ref, o_ref,
                      q_smem, k_smem, v_smem, p_smem, o_smem, barriers, *, sm_scale, group):
    # items_ref: int32[W, 4]; page_table_ref: int32[S, pages_per_seq]
    # q_ref: [T + BLOCK_Q, N, H] (zero rows past T); k_pages_ref, v_pages_ref: [P, L, K, H]
    # o_ref: [T, N, H]; q_smem, o_smem: [BLOCK_Q, H]; k_smem, v_smem: [BLOCK_K, H];
    # p_smem: [BLOCK_Q, BLOCK_K]
    item, head = lax.axis_index("item"), lax.axis_index("head")
    kv_head, head_dim = head // group, q_ref.shape[2]
    row_start, row_end = items_ref[item, ROW_START], items_ref[item, ROW_END]
    pos_offset, seq = items_ref[item, POS_OFFSET], items_ref[item, SEQ]
    num_keys = jnp.maximum(row_end + pos_offset, 0)
    # A row start that is no multiple of 8 cannot be copied into the tiled WGMMA operand:
    # TMA into the untiled o_smem, then through registers.
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row_start, BLOCK_Q), head], o_smem,
                            barriers.at[0])
    plgpu.barrier_wait(barriers.at[0])
    q_smem[...] = o_smem[...]
    plgpu.commit_smem()
    shape = (BLOCK_Q, BLOCK_K)
    row_pos = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=_WGMMA) + row_start + pos_offset

    def step(block, carry):
        acc, row_max, row_sum = carry
        _load_key_block(page_table_ref, k_pages_ref, v_pages_ref, k_smem, v_smem, barriers,
                        seq=seq, kv_head=kv_head, block=block)
        key_pos = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_WGMMA) + block * BLOCK_K
        visible = (key_pos < num_keys) & (key_pos <= row_pos)
        scores = _matmul(q_smem, k_smem.transpose((1, 0)), shape) * sm_scale
        scores = jnp.where(visible, scores, MASK_VALUE)                    # [bq, bk]
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp(row_max - new_max)                            # [bq]
        probs = jnp.where(visible, jnp.exp(scores - lax.broadcast_in_dim(new_max, shape, [0])),
                          0.0)
        row_sum = row_sum * correction + probs.sum(axis=1)

        @pl.when((block + 1) * BLOCK_K > num_keys)
        def _():  # slots past the context may hold anything (NaN): 0 * NaN is NaN
            key = plgpu.broadcasted_iota(jnp.int32, v_smem.shape, 0, layout=_WGMMA)
            v_smem[...] = plgpu.layout_cast(
                jnp.where(key + block * BLOCK_K < num_keys, v_smem[...], 0).astype(
                    v_smem.dtype), _WGMMA)
            plgpu.commit_smem()

        p_smem[...] = plgpu.layout_cast(probs.astype(p_smem.dtype), _WGMMA)
        plgpu.commit_smem()
        values = _matmul(p_smem, v_smem, (BLOCK_Q, head_dim))              # [bq, H]
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + values
        return acc, new_max, row_sum

    init = (plgpu.layout_cast(jnp.zeros((BLOCK_Q, head_dim), jnp.float32), _WGMMA),
            plgpu.layout_cast(jnp.full((BLOCK_Q,), MASK_VALUE, jnp.float32), _ROW),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), _ROW))
    acc, _, row_sum = lax.fori_loop(0, pl.cdiv(num_keys, BLOCK_K), step, init)
    # Rows with no keys (the padding segment) have row_sum 0 and come out as zeros.
    out = acc / lax.broadcast_in_dim(jnp.where(row_sum > 0, row_sum, 1.0), acc.shape, [0])
    o_smem[...] = plgpu.layout_cast(out.astype(o_smem.dtype), _WGMMA)
    plgpu.commit_smem()
    store_rows(o_smem, lambda start, size: o_ref.at[pl.ds(start, size), head],
               smem_start=0, gmem_start=row_start, num_rows=row_end - row_start,
               max_rows=min(BLOCK_Q, o_ref.shape[0]))


def mosaic_unsupported_reason(q, k_pages, plan: MosaicAttentionPlan, *, k_scale=None,
                              v_scale=None) -> str | None:
    """None when the Mosaic kernel takes this call, else why the Triton kernel runs."""
    version = attention_unsupported_reason()
    if version is not None:
        return version
    if plan.prefill is None:
        return "a decode step: the Triton kernel (with flash-decoding splits) runs"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype:
        return (f"q {q.dtype}, pages {k_pages.dtype}: the Mosaic GPU kernel takes 16-bit "
                "float queries and pages of the same dtype")
    if k_scale is not None or v_scale is not None:
        return "scaled pages: the Mosaic GPU kernel reads unscaled pages"
    page_size, head_dim = k_pages.shape[1], q.shape[2]
    if page_size % 8 or BLOCK_K % page_size:
        return f"page size {page_size}: expected a multiple of 8 dividing {BLOCK_K}"
    if head_dim not in (64, 128):
        return f"head dim {head_dim}: expected 64 or 128"
    return None


def _attention_mosaic(q, k_pages, v_pages, page_table, items, *, sm_scale, interpret):
    """The Mosaic GPU launch: q [T, N, H] -> [T, N, H]."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_pages.shape[2]
    # Every program reads 64 rows from its item's start: zero rows past the end.
    q_padded = jnp.pad(q, ((0, BLOCK_Q), (0, 0), (0, 0)))
    tile = lambda rows: plgpu.SMEM((rows, head_dim), q.dtype)
    kernel = functools.partial(_attention_kernel, sm_scale=float(sm_scale), group=group)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(items.shape[0], num_q_heads), grid_names=("item", "head"),
        scratch_types=[tile(BLOCK_Q), tile(BLOCK_K), tile(BLOCK_K),
                       plgpu.SMEM((BLOCK_Q, BLOCK_K), q.dtype), tile(BLOCK_Q),
                       plgpu.Barrier(num_barriers=max(1, 2 * BLOCK_K // k_pages.shape[1]))],
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_arg(interpret),
    )(items, page_table.astype(jnp.int32), q_padded, k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "interpret", "block_q", "block_k", "num_warps", "num_stages", "num_splits"))
def ragged_paged_attention_mosaic(q, k_pages, v_pages, kv_lens, page_table, query_start,
                                  num_seqs, *, sm_scale, k_scale=None, v_scale=None,
                                  plan: MosaicAttentionPlan | None = None, interpret=False,
                                  block_q=None, block_k=None, num_warps=None,
                                  num_stages=None, num_splits=None):
    """`ragged_paged_attention`'s contract and arguments, with prefill steps in the Mosaic
    GPU kernel; other calls (`mosaic_unsupported_reason`) run the Triton kernel, which
    alone reads the block arguments. `plan`: `plan_attention_mosaic`'s."""
    check_attention_args(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                         k_scale, v_scale)
    if plan is None:
        plan = plan_attention_mosaic(
            query_start, kv_lens, num_seqs, num_tokens=q.shape[0], num_q_heads=q.shape[1],
            num_kv_heads=k_pages.shape[2], head_dim=q.shape[2], block_q=block_q,
            num_splits=num_splits)
    if mosaic_unsupported_reason(q, k_pages, plan, k_scale=k_scale,
                                 v_scale=v_scale) is not None:
        return ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
            sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, plan=plan.triton,
            interpret=interpret, block_q=block_q, block_k=block_k, num_warps=num_warps,
            num_stages=num_stages, num_splits=num_splits)
    return _attention_mosaic(q, k_pages, v_pages, page_table, plan.prefill.items,
                             sm_scale=sm_scale, interpret=interpret)
