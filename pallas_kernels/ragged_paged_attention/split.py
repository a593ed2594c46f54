"""Flash-decoding: each item's keys split across `num_splits` programs, combined after.

At batch 1 a decode step has one program per kv head; splitting the context lets every
SM read a slice of it. Each split writes its unnormalised fp32 accumulator with its
running max and sum; a second small kernel merges the splits per (token, kv head) and
applies the value scale, in the same step.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention.attend import MASK_VALUE, attend, load_item


def _split_kernel(items_ref, page_table_ref, k_scale_ref, v_scale_ref, q_ref, k_pages_ref,
                  v_pages_ref, acc_ref, max_ref, sum_ref, *, sm_scale, block_q, block_k,
                  num_splits, precision):
    # q_ref: [T, K, G, H]; acc_ref: f32[splits, T, K, G, H]; max_ref, sum_ref: f32[splits, T, K, G]
    del v_scale_ref  # applied by the combine
    item, kv_head, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group, head_dim = q_ref.shape[2], q_ref.shape[3]
    q, row_pos, row_start, row_mask, seq, num_keys = load_item(
        items_ref, q_ref, item, kv_head, block_q=block_q)
    # Whole key blocks per split, so a split never starts inside a block.
    chunk = pl.cdiv(pl.cdiv(num_keys, num_splits), block_k) * block_k
    key_start = part * chunk
    acc, row_max, row_sum = attend(
        page_table_ref, k_pages_ref, v_pages_ref, q=q, row_pos=row_pos, seq=seq,
        kv_head=kv_head, key_start=key_start,
        key_stop=jnp.minimum(num_keys, key_start + chunk),
        score_scale=sm_scale * k_scale_ref[kv_head], block_k=block_k, precision=precision)
    rows = pl.ds(row_start, block_q)
    pltriton.store(acc_ref.at[part, rows, kv_head], acc.reshape(block_q, group, head_dim),
                   mask=row_mask[:, None, None])
    pltriton.store(max_ref.at[part, rows, kv_head], row_max.reshape(block_q, group),
                   mask=row_mask[:, None])
    pltriton.store(sum_ref.at[part, rows, kv_head], row_sum.reshape(block_q, group),
                   mask=row_mask[:, None])


def _combine_kernel(v_scale_ref, acc_ref, max_ref, sum_ref, o_ref, *, num_splits):
    # acc_ref: f32[splits, T, K, G, H]; max_ref, sum_ref: f32[splits, T, K, G]
    # o_ref: [T, K, G, H]
    token, kv_head = pl.program_id(0), pl.program_id(1)

    def body(part, carry):
        row_max, row_sum, acc = carry                                      # [G], [G], [G, H]
        part_max = max_ref[part, token, kv_head]
        new_max = jnp.maximum(row_max, part_max)
        old_scale = jnp.exp(row_max - new_max)
        part_scale = jnp.exp(part_max - new_max)
        row_sum = row_sum * old_scale + sum_ref[part, token, kv_head] * part_scale
        acc = acc * old_scale[:, None] + acc_ref[part, token, kv_head] * part_scale[:, None]
        return new_max, row_sum, acc

    group, head_dim = o_ref.shape[2], o_ref.shape[3]
    init = (jnp.full((group,), MASK_VALUE, jnp.float32),
            jnp.zeros((group,), jnp.float32), jnp.zeros((group, head_dim), jnp.float32))
    _, row_sum, acc = jax.lax.fori_loop(0, num_splits, body, init)
    # Rows that saw no key in any split (padding) have row_sum 0 and come out as zeros.
    out = acc * (v_scale_ref[kv_head] / jnp.where(row_sum > 0, row_sum, 1.0))[:, None]
    o_ref[token, kv_head] = out.astype(o_ref.dtype)


def split_attention(items, page_table, k_scale, v_scale, q4, k_pages, v_pages, *, sm_scale,
                    block_q, block_k, num_splits, precision, compiler_params, interpret):
    """The split pass and the combine: q4 [T, K, G, H] -> [T, K, G, H] in q's dtype."""
    num_tokens, num_kv_heads, group, head_dim = q4.shape
    f32 = jnp.float32
    parts = pl.pallas_call(
        functools.partial(_split_kernel, sm_scale=float(sm_scale), block_q=block_q,
                          block_k=block_k, num_splits=num_splits, precision=precision),
        grid=(items.shape[0], num_kv_heads, num_splits),
        out_shape=(jax.ShapeDtypeStruct((num_splits, *q4.shape), f32),
                   jax.ShapeDtypeStruct((num_splits, *q4.shape[:3]), f32),
                   jax.ShapeDtypeStruct((num_splits, *q4.shape[:3]), f32)),
        compiler_params=compiler_params, interpret=interpret,
        name="ragged_paged_attention_split",
    )(items, page_table, k_scale, v_scale, q4, k_pages, v_pages)
    return pl.pallas_call(
        functools.partial(_combine_kernel, num_splits=num_splits),
        grid=(num_tokens, num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="ragged_paged_attention_combine",
    )(v_scale, *parts)
