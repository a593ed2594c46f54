"""Ragged paged attention as a Triton-backed Pallas kernel.

Work is split into items of at most `block_q` query rows of one sequence (planned once
per step, see plan.py), times one kv head; each program gathers its keys page by page
through the page table and runs an online softmax in fp32. One extra segment covers the
padding rows so they are written as zeros without touching the cache. Decode steps of
few sequences also split each item's keys across programs (split.py).

Where it runs: all attention of impl "pallas" on a GPU, and under impl "mosaic" every
decode step, fp8/int8 pages, fp32 and, on jax 0.10, everything (mosaic.py's
`mosaic_unsupported_reason`). On a CPU only with `interpret=True` (the tests).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.typing import ArrayLike

from pallas_kernels.array_types import Array, Float, Int, Shaped
from pallas_kernels.ragged_paged_attention import split, tuning
from pallas_kernels.ragged_paged_attention.attend import attend, load_item
from pallas_kernels.ragged_paged_attention.plan import AttentionPlan, padded_group, plan_attention
from pallas_kernels.ragged_paged_attention.shapes import (
    check_attention_args,
    check_attention_blocks,
)


def _attention_kernel(items_ref, page_table_ref, k_scale_ref, v_scale_ref, q_ref,
                      k_pages_ref, v_pages_ref, o_ref, *, sm_scale, block_q, block_k,
                      precision):
    # items_ref: int32[W, 4]; page_table_ref: int32[S, pages_per_seq]
    # k_scale_ref, v_scale_ref: float32[K]; q_ref, o_ref: [T, K, G, H]
    # k_pages_ref, v_pages_ref: [P, L, K, H]
    item, kv_head = pl.program_id(0), pl.program_id(1)
    group, head_dim = q_ref.shape[2], q_ref.shape[3]
    q, row_pos, row_start, row_mask, seq, num_keys = load_item(items_ref, q_ref, item,
                                                               kv_head, block_q=block_q)
    acc, _, row_sum = attend(page_table_ref, k_pages_ref, v_pages_ref, q=q, row_pos=row_pos,
                             seq=seq, kv_head=kv_head, key_start=0, key_stop=num_keys,
                             score_scale=sm_scale * k_scale_ref[kv_head], block_k=block_k,
                             precision=precision)
    # Rows with no keys (the padding segment) have row_sum 0 and come out as zeros.
    out = acc * (v_scale_ref[kv_head] / jnp.where(row_sum > 0, row_sum, 1.0))[:, None]
    out = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)
    pltriton.store(o_ref.at[pl.ds(row_start, block_q), kv_head], out,
                   mask=row_mask[:, None, None])


def _plan(args, plan, *, num_q_heads, head_dim, block_q, num_splits):
    q_len, kv_lens, query_start, num_seqs, num_kv_heads = args
    if plan is None:
        return plan_attention(query_start, kv_lens, num_seqs, num_tokens=q_len,
                              num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, block_q=block_q, num_splits=num_splits)
    for name, given, planned in (("block_q", block_q, plan.block_q),
                                 ("num_splits", num_splits, plan.num_splits)):
        if given not in (None, planned):
            raise ValueError(f"{name} is {given}, expected the plan's {planned}")
    return plan


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "interpret", "block_q", "block_k", "num_warps", "num_stages", "num_splits"))
def ragged_paged_attention(q: Float[ArrayLike, "T N H"], k_pages: Shaped[ArrayLike, "P L K H"],
                           v_pages: Shaped[ArrayLike, "P L K H"], kv_lens: Int[ArrayLike, " S"],
                           page_table: Int[ArrayLike, "S pages_per_seq"],
                           query_start: Int[ArrayLike, " S+1"], num_seqs: Int[ArrayLike, ""],
                           *, sm_scale, k_scale: Float[ArrayLike, " K"] | None = None,
                           v_scale: Float[ArrayLike, " K"] | None = None,
                           plan: AttentionPlan | None = None, interpret=False, block_q=None,
                           block_k=None, num_warps=None, num_stages=None, num_splits=None
                           ) -> Float[Array, "T N H"]:
    """Causal attention of ragged query rows over a paged KV cache (Pallas kernel).

    Same contract as `ragged_paged_attention_reference`. `plan` (plan_attention) is
    built once per step and shared by the layers; without it the call builds its own.
    Block sizes default to the tuning table; `interpret=True` runs the kernel on CPU.
    """
    check_attention_args(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                         k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group, padded = num_q_heads // num_kv_heads, padded_group(num_q_heads, num_kv_heads)
    plan = _plan((num_tokens, kv_lens, query_start, num_seqs, num_kv_heads), plan,
                 num_q_heads=num_q_heads, head_dim=head_dim, block_q=block_q,
                 num_splits=num_splits)
    blocks = tuning.attention_blocks(num_tokens=num_tokens, num_seqs_max=kv_lens.shape[0],
                                     group=padded, head_dim=head_dim)
    block_k = block_k or blocks.block_k
    check_attention_blocks(block_q=plan.block_q, block_k=block_k, group=padded)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)              # [T, K, G, H]
    if padded != group:  # Triton tiles are powers of two: pad with zero heads
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
    ones = jnp.ones((num_kv_heads,), jnp.float32)
    k_scale = ones if k_scale is None else k_scale.astype(jnp.float32)
    v_scale = ones if v_scale is None else v_scale.astype(jnp.float32)
    precision = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    params = pltriton.CompilerParams(num_warps=num_warps or blocks.num_warps,
                                     num_stages=num_stages or blocks.num_stages)
    args = (plan.items, page_table.astype(jnp.int32), k_scale, v_scale, q4, k_pages, v_pages)
    if plan.num_splits > 1:
        out = split.split_attention(*args, sm_scale=sm_scale, block_q=plan.block_q,
                                    block_k=block_k, num_splits=plan.num_splits,
                                    precision=precision, compiler_params=params,
                                    interpret=interpret)
    else:
        kernel = functools.partial(_attention_kernel, sm_scale=float(sm_scale),
                                   block_q=plan.block_q, block_k=block_k,
                                   precision=precision)
        out = pl.pallas_call(
            kernel, grid=(plan.items.shape[0], num_kv_heads),
            out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype), compiler_params=params,
            interpret=interpret, name="ragged_paged_attention")(*args)
    return out[:, :, :group].reshape(q.shape)
