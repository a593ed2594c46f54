"""Ragged paged attention as a Triton-backed Pallas kernel.

Work is split into items of at most `block_q` query rows of one sequence (planned in XLA
before the call, see `_plan_items`), times one kv head; each program gathers its keys
page by page through the page table and runs an online softmax in fp32. One extra
segment covers the padding rows so they are written as zeros without touching the cache.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.ragged_paged_attention import tuning
from pallas_kernels.ragged_paged_attention.shapes import (
    check_attention_args,
    check_attention_blocks,
)

# Finite, so a fully masked key block never produces inf - inf = NaN.
_MASK_VALUE = -1e30
# Columns of the work-item table built by `_plan_items`.
_ROW_START, _ROW_END, _POS_OFFSET, _SEQ = range(4)


def _gather_keys(page_table_ref, k_pages_ref, v_pages_ref, *, seq, kv_head, key_pos,
                 key_mask, dtype):
    """Keys and values at positions key_pos of sequence seq: ([bk, H], [bk, H]) in dtype."""
    page_size, head_dim = k_pages_ref.shape[1], k_pages_ref.shape[3]
    pages = pltriton.load(page_table_ref.at[seq, key_pos // page_size],
                          mask=key_mask, other=0)                          # [bk]
    dims = jnp.arange(head_dim, dtype=jnp.int32)                           # [H]
    # Every index is an array (no slices): a gather both Triton and the CPU
    # interpreter accept, with each key's head_dim row contiguous in memory.
    at = (pages[:, None], (key_pos % page_size)[:, None], kv_head, dims[None, :])
    mask = key_mask[:, None]
    # Zero the masked keys after the cast: Triton cannot build an fp8 `other`, and
    # masked lanes must not carry NaN garbage into P @ V.
    k = jnp.where(mask, pltriton.load(k_pages_ref.at[at], mask=mask).astype(dtype), 0)
    v = jnp.where(mask, pltriton.load(v_pages_ref.at[at], mask=mask).astype(dtype), 0)
    return k, v


def _attention_kernel(items_ref, page_table_ref, k_scale_ref, v_scale_ref, q_ref,
                      k_pages_ref, v_pages_ref, o_ref, *, sm_scale, block_q, block_k,
                      precision):
    # items_ref: int32[W, 4]; page_table_ref: int32[S, pages_per_seq]
    # k_scale_ref, v_scale_ref: float32[K]; q_ref, o_ref: [T, K, G, H]
    # k_pages_ref, v_pages_ref: [P, L, K, H]
    item, kv_head = pl.program_id(0), pl.program_id(1)
    group, head_dim = q_ref.shape[2], q_ref.shape[3]
    row_start = items_ref[item, _ROW_START]
    row_end = items_ref[item, _ROW_END]
    pos_offset = items_ref[item, _POS_OFFSET]
    seq = items_ref[item, _SEQ]

    rows = row_start + jnp.arange(block_q, dtype=jnp.int32)                # [bq]
    row_mask = rows < row_end                                              # [bq]
    # A contiguous row slice (not a gather) so masked rows never alias a real row.
    row_slice = pl.ds(row_start, block_q)
    q = pltriton.load(q_ref.at[row_slice, kv_head], mask=row_mask[:, None, None],
                      other=0)                                             # [bq, G, H]
    q = q.reshape(block_q * group, head_dim)                               # [R, H]
    row_pos = jnp.broadcast_to((rows + pos_offset)[:, None], (block_q, group))
    row_pos = row_pos.reshape(block_q * group)                             # [R]
    # The last row's position bounds the keys any row of this item can see.
    num_keys = jnp.maximum(row_end + pos_offset, 0)
    compute_dtype = q.dtype
    score_scale = sm_scale * k_scale_ref[kv_head]

    def body(step, carry):
        acc, row_max, row_sum = carry         # [R, H], [R], [R] float32
        key_pos = step * block_k + jnp.arange(block_k, dtype=jnp.int32)    # [bk]
        key_mask = key_pos < num_keys
        k, v = _gather_keys(page_table_ref, k_pages_ref, v_pages_ref, seq=seq,
                            kv_head=kv_head, key_pos=key_pos, key_mask=key_mask,
                            dtype=compute_dtype)                           # [bk, H] each
        scores = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32) * score_scale              # [R, bk]
        visible = (key_pos[None, :] <= row_pos[:, None]) & key_mask[None, :]
        scores = jnp.where(visible, scores, _MASK_VALUE)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        correction = jnp.exp(row_max - new_max)                            # [R]
        probs = jnp.exp(scores - new_max[:, None])                         # [R, bk]
        row_sum = row_sum * correction + jnp.sum(probs, axis=1)
        acc = acc * correction[:, None] + jax.lax.dot_general(
            probs.astype(compute_dtype), v,
            (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)                            # [R, H]
        return acc, new_max, row_sum

    init = (jnp.zeros((block_q * group, head_dim), jnp.float32),
            jnp.full((block_q * group,), _MASK_VALUE, jnp.float32),
            jnp.zeros((block_q * group,), jnp.float32))
    acc, _, row_sum = jax.lax.fori_loop(0, pl.cdiv(num_keys, block_k), body, init)
    # Rows with no keys (the padding segment) have row_sum 0 and come out as zeros.
    out = acc * (v_scale_ref[kv_head] / jnp.where(row_sum > 0, row_sum, 1.0))[:, None]
    out = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)
    pltriton.store(o_ref.at[row_slice, kv_head], out, mask=row_mask[:, None, None])


def _plan_items(query_start, kv_lens, num_seqs, *, num_tokens, block_q):
    """int32[W, 4] work items: rows [start, end) of one segment, position offset, sequence.

    Segments are the real sequences plus one trailing segment of padding rows. Each
    segment of n rows needs cdiv(n, block_q) items, so W = cdiv(T, bq) + S + 1 covers
    any split; unused items have no rows and no keys.
    """
    num_seqs_max = kv_lens.shape[0]
    seq_ids = jnp.arange(num_seqs_max, dtype=jnp.int32)
    real = seq_ids < num_seqs
    seq_start = jnp.where(real, query_start[:-1], 0)
    seq_len = jnp.where(real, query_start[1:] - query_start[:-1], 0)
    pad_start = query_start[jnp.clip(num_seqs, 0, num_seqs_max)]
    starts = jnp.append(seq_start, pad_start)                              # [S+1]
    lens = jnp.append(seq_len, num_tokens - pad_start)                     # [S+1]
    # Row r of sequence s sits at position r + kv_len - (end of s); the padding
    # segment gets an offset that puts every row before position 0, so it sees no keys.
    offsets = jnp.append(kv_lens - (seq_start + seq_len), -2 * num_tokens - block_q)
    blocks = -(-lens // block_q)                                           # [S+1]
    ends_cum = jnp.cumsum(blocks)
    num_items = -(-num_tokens // block_q) + num_seqs_max + 1
    item_ids = jnp.arange(num_items, dtype=jnp.int32)
    seg = jnp.clip(jnp.searchsorted(ends_cum, item_ids, side="right"), 0, num_seqs_max)
    used = item_ids < ends_cum[-1]
    row_start = starts[seg] + (item_ids - (ends_cum[seg] - blocks[seg])) * block_q
    row_end = jnp.minimum(row_start + block_q, starts[seg] + lens[seg])
    row_start = jnp.where(used, row_start, 0)
    row_end = jnp.where(used, row_end, 0)
    pos_offset = jnp.where(used, offsets[seg], -2 * num_tokens - block_q)
    seq = jnp.minimum(seg, num_seqs_max - 1)
    return jnp.stack([row_start, row_end, pos_offset, seq], axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "interpret", "block_q", "block_k", "num_warps", "num_stages"))
def ragged_paged_attention(q: Float[ArrayLike, "T N H"], k_pages: Shaped[ArrayLike, "P L K H"],
                           v_pages: Shaped[ArrayLike, "P L K H"], kv_lens: Int[ArrayLike, " S"],
                           page_table: Int[ArrayLike, "S pages_per_seq"],
                           query_start: Int[ArrayLike, " S+1"], num_seqs: Int[ArrayLike, ""],
                           *, sm_scale, k_scale: Float[ArrayLike, " K"] | None = None,
                           v_scale: Float[ArrayLike, " K"] | None = None, interpret=False,
                           block_q=None, block_k=None, num_warps=None, num_stages=None
                           ) -> Float[Array, "T N H"]:
    """Causal attention of ragged query rows over a paged KV cache (Pallas kernel).

    Same contract as `ragged_paged_attention_reference`. Block sizes default to the
    tuning table; `interpret=True` runs the kernel on CPU.
    """
    check_attention_args(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                         k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    # Triton tiles are powers of two: pad the group with zero heads when needed.
    padded_group = 1 << (group - 1).bit_length()
    blocks = tuning.attention_blocks(num_tokens=num_tokens, num_seqs_max=kv_lens.shape[0],
                                     group=padded_group, head_dim=head_dim)
    block_q = block_q or blocks.block_q
    block_k = block_k or blocks.block_k
    check_attention_blocks(block_q=block_q, block_k=block_k, group=padded_group)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)              # [T, K, G, H]
    if padded_group != group:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, padded_group - group), (0, 0)))
    items = _plan_items(query_start.astype(jnp.int32), kv_lens.astype(jnp.int32),
                        jnp.asarray(num_seqs, jnp.int32), num_tokens=num_tokens,
                        block_q=block_q)
    ones = jnp.ones((num_kv_heads,), jnp.float32)
    k_scale = ones if k_scale is None else k_scale.astype(jnp.float32)
    v_scale = ones if v_scale is None else v_scale.astype(jnp.float32)
    precision = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    kernel = functools.partial(_attention_kernel, sm_scale=float(sm_scale), block_q=block_q,
                               block_k=block_k, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=(items.shape[0], num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or blocks.num_warps,
            num_stages=num_stages or blocks.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(items, page_table.astype(jnp.int32), k_scale, v_scale, q4, k_pages, v_pages)
    return out[:, :, :group].reshape(q.shape)
