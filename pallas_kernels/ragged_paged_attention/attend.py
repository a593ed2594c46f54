"""The body shared by the attention kernels: an item's query tile, the key gather through
the page table, and the online softmax over a range of keys."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention.plan import POS_OFFSET, ROW_END, ROW_START, SEQ

# Finite, so a fully masked key block never produces inf - inf = NaN.
MASK_VALUE = -1e30


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


def load_item(items_ref, q_ref, item, kv_head, *, block_q):
    """An item's query tile and bounds: (q [R, H], row_pos [R], rows, row_mask, seq,
    num_keys) with R = block_q * group rows."""
    group, head_dim = q_ref.shape[2], q_ref.shape[3]
    row_start = items_ref[item, ROW_START]
    row_end = items_ref[item, ROW_END]
    pos_offset = items_ref[item, POS_OFFSET]
    rows = row_start + jnp.arange(block_q, dtype=jnp.int32)                # [bq]
    row_mask = rows < row_end
    # A contiguous row slice (not a gather) so masked rows never alias a real row.
    q = pltriton.load(q_ref.at[pl.ds(row_start, block_q), kv_head],
                      mask=row_mask[:, None, None], other=0)               # [bq, G, H]
    row_pos = jnp.broadcast_to((rows + pos_offset)[:, None], (block_q, group))
    # The last row's position bounds the keys any row of this item can see.
    num_keys = jnp.maximum(row_end + pos_offset, 0)
    return (q.reshape(block_q * group, head_dim), row_pos.reshape(block_q * group),
            row_start, row_mask, items_ref[item, SEQ], num_keys)


def attend(page_table_ref, k_pages_ref, v_pages_ref, *, q, row_pos, seq, kv_head,
           key_start, key_stop, score_scale, block_k, precision):
    """Online softmax of q over keys [key_start, key_stop) (key_start a multiple of
    block_k): (acc [R, H], row_max [R], row_sum [R]) in float32, acc unnormalised."""
    compute_dtype = q.dtype

    def body(step, carry):
        acc, row_max, row_sum = carry
        key_pos = step * block_k + jnp.arange(block_k, dtype=jnp.int32)    # [bk]
        key_mask = key_pos < key_stop
        k, v = _gather_keys(page_table_ref, k_pages_ref, v_pages_ref, seq=seq,
                            kv_head=kv_head, key_pos=key_pos, key_mask=key_mask,
                            dtype=compute_dtype)                           # [bk, H] each
        scores = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32) * score_scale              # [R, bk]
        visible = (key_pos[None, :] <= row_pos[:, None]) & key_mask[None, :]
        scores = jnp.where(visible, scores, MASK_VALUE)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        correction = jnp.exp(row_max - new_max)                            # [R]
        probs = jnp.exp(scores - new_max[:, None])                         # [R, bk]
        row_sum = row_sum * correction + jnp.sum(probs, axis=1)
        acc = acc * correction[:, None] + jax.lax.dot_general(
            probs.astype(compute_dtype), v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)                            # [R, H]
        return acc, new_max, row_sum

    num_rows, head_dim = q.shape
    init = (jnp.zeros((num_rows, head_dim), jnp.float32),
            jnp.full((num_rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((num_rows,), jnp.float32))
    first = key_start // block_k
    last = jnp.maximum(first, pl.cdiv(key_stop, block_k))
    return jax.lax.fori_loop(first, last, body, init)
