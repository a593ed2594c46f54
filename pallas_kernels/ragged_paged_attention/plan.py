"""The attention work plan of one step: built once from the step's metadata and shared
by every layer (it does not depend on the layer), so the layer scan holds no planning.

Work items are at most `block_q` query rows of one sequence, plus one trailing segment
covering the padding rows (they see no keys and are written as zeros). With
`num_splits` > 1 (decode steps of few sequences) each item's keys are also split
across programs (flash-decoding) and combined in the same call.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import tuning

# Columns of the work-item table.
ROW_START, ROW_END, POS_OFFSET, SEQ = range(4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    items: jax.Array  # int32[W, 4]: rows [start, end), position offset, sequence
    block_q: int = dataclasses.field(metadata=dict(static=True))
    num_splits: int = dataclasses.field(metadata=dict(static=True))


def padded_group(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per kv head, padded to a power of two (Triton tiles)."""
    group = num_q_heads // num_kv_heads
    return 1 << (group - 1).bit_length()


def _items(query_start, kv_lens, num_seqs, *, num_tokens, block_q):
    """int32[W, 4]; W = cdiv(T, bq) + S + 1 covers any split, unused items have no rows.

    Row r of sequence s sits at position r + kv_len - (end of s); the padding segment
    gets an offset that puts every row before position 0, so it sees no keys."""
    num_seqs_max = kv_lens.shape[0]
    real = jnp.arange(num_seqs_max, dtype=jnp.int32) < num_seqs
    seq_start = jnp.where(real, query_start[:-1], 0)
    seq_len = jnp.where(real, query_start[1:] - query_start[:-1], 0)
    pad_start = query_start[jnp.clip(num_seqs, 0, num_seqs_max)]
    starts = jnp.append(seq_start, pad_start)                              # [S+1]
    lens = jnp.append(seq_len, num_tokens - pad_start)                     # [S+1]
    no_keys = -2 * num_tokens - block_q
    offsets = jnp.append(kv_lens - (seq_start + seq_len), no_keys)
    blocks = -(-lens // block_q)                                           # [S+1]
    ends_cum = jnp.cumsum(blocks)
    num_items = -(-num_tokens // block_q) + num_seqs_max + 1
    item_ids = jnp.arange(num_items, dtype=jnp.int32)
    # compare_all: one [W, S+1] comparison, where the default method is a loop.
    seg = jnp.clip(jnp.searchsorted(ends_cum, item_ids, side="right", method="compare_all"),
                   0, num_seqs_max)
    used = item_ids < ends_cum[-1]
    row_start = starts[seg] + (item_ids - (ends_cum[seg] - blocks[seg])) * block_q
    row_end = jnp.minimum(row_start + block_q, starts[seg] + lens[seg])
    return jnp.stack([jnp.where(used, row_start, 0), jnp.where(used, row_end, 0),
                      jnp.where(used, offsets[seg], no_keys),
                      jnp.minimum(seg, num_seqs_max - 1)], axis=1).astype(jnp.int32)


def plan_attention(query_start, kv_lens, num_seqs, *, num_tokens, num_q_heads,
                   num_kv_heads, head_dim, block_q=None, num_splits=None) -> AttentionPlan:
    """The plan for a step of `num_tokens` query rows (block sizes from tuning.py)."""
    group = padded_group(num_q_heads, num_kv_heads)
    num_seqs_max = kv_lens.shape[0]
    blocks = tuning.attention_blocks(num_tokens=num_tokens, num_seqs_max=num_seqs_max,
                                     group=group, head_dim=head_dim)
    block_q = block_q or blocks.block_q
    if num_splits is None:
        num_splits = tuning.decode_splits(num_tokens=num_tokens, num_seqs_max=num_seqs_max,
                                          num_kv_heads=num_kv_heads)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits is {num_splits}, expected a power of two >= 1")
    items = _items(query_start.astype(jnp.int32), kv_lens.astype(jnp.int32),
                   jnp.asarray(num_seqs, jnp.int32), num_tokens=num_tokens, block_q=block_q)
    return AttentionPlan(items=items, block_q=block_q, num_splits=num_splits)
