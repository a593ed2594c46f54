"""Plain-jnp ragged paged attention: the correctness oracle and the CPU implementation.

Query rows are grouped into blocks of B rows of one sequence (B from the step's static
token and sequence counts, 1 for decode steps), and each block gathers its sequence's
keys once: a prefill chunk of Q rows reads its context Q / B times, not Q times. The
keys are visited in chunks of pages with an online softmax, up to the furthest real
position (a dynamic trip count), so the cost follows the real context; the blocks are
sorted by context length and run in groups, each group to its own furthest position, so
a long decode beside short prefill chunks does not stretch them all.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from pallas_kernels.array_types import Array, Float, Int, Shaped

# At most this many query blocks gather their keys at once (a bound on the gathered
# [blocks, C, K, H] keys; more blocks run in more groups under lax.map).
_MAX_BLOCKS = 128
# Blocks run in this many groups (sorted by context length, so each group visits only the
# key chunks its own longest context needs) once there are 4 blocks a group or more.
_GROUPS = 4
# Pages of keys per online-softmax step.
_CHUNK_PAGES = 8


def rows_per_block(num_tokens: int, num_seqs_max: int) -> int:
    """B: the power of two nearest below T / S. A step then has at most T / B + S
    blocks, so about T padding rows at most, while each sequence's rows gather its keys
    ~B times less often than one row at a time. 1 (a block per row) where blocks would
    not be fewer than rows: decode steps."""
    ratio = max(1, num_tokens // max(1, num_seqs_max))
    rows = 1 << (ratio.bit_length() - 1)
    return rows if -(-num_tokens // rows) + num_seqs_max < num_tokens else 1


def num_blocks_bound(num_tokens: int, num_seqs_max: int, rows: int) -> int:
    """sum over sequences of ceil(q_len / B) <= T / B + S, and never more than T."""
    return min(num_tokens, -(-num_tokens // rows) + (num_seqs_max if rows > 1 else 0))


def _dequant(pages, scale):
    """[P, L, K, H] stored pages -> float32 values (scale: float32[K] or None)."""
    values = pages.astype(jnp.float32)
    if scale is not None:
        values = values * scale.astype(jnp.float32)[None, None, :, None]
    return values


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReferencePlan:
    """A step's query blocks (NB blocks of B rows, each within one sequence), longest
    context first, and where each query row's output sits among them."""
    block_seq: jax.Array   # int32[NB] sequence of each block (0 for empty blocks)
    block_rows: jax.Array  # int32[NB, B] query row of each slot (0 where none)
    block_pos: jax.Array   # int32[NB, B] absolute position of each slot, -1 where none
    row_slot: jax.Array    # int32[T] block * B + offset of each query row
    valid: jax.Array       # bool[T] real query rows


def plan_attention_reference(query_start, kv_lens, num_seqs, *, num_tokens, num_q_heads=None,
                             num_kv_heads=None, head_dim=None, block_q=None,
                             num_splits=None) -> ReferencePlan:
    """The reference's per-step plan; same signature as the kernel's `plan_attention`."""
    del num_q_heads, num_kv_heads, head_dim, block_q, num_splits
    query_start, kv_lens = jnp.asarray(query_start), jnp.asarray(kv_lens)
    num_seqs_max = kv_lens.shape[0]
    rows = rows_per_block(num_tokens, num_seqs_max)
    num_blocks = num_blocks_bound(num_tokens, num_seqs_max, rows)
    real = jnp.arange(num_seqs_max) < num_seqs
    q_lens = jnp.where(real, query_start[1:] - query_start[:-1], 0)              # [S]
    seq_blocks = (q_lens + rows - 1) // rows                                      # [S]
    block_end = jnp.cumsum(seq_blocks)                                            # [S]
    block_start = block_end - seq_blocks
    block = jnp.arange(num_blocks, dtype=jnp.int32)                               # [NB]
    block_seq = jnp.minimum(jnp.sum(block[:, None] >= block_end[None, :], axis=1,
                                    dtype=jnp.int32), num_seqs_max - 1)           # [NB]
    first = query_start[block_seq] + (block - block_start[block_seq]) * rows     # [NB]
    block_rows = first[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]     # [NB, B]
    real_slot = ((block < block_end[-1])[:, None]
                 & (block_rows < (query_start[block_seq] + q_lens[block_seq])[:, None]))
    ctx_start = kv_lens - q_lens  # first position of each sequence's chunk
    block_pos = jnp.where(real_slot, (ctx_start[block_seq] - query_start[block_seq])[:, None]
                          + block_rows, -1)
    # Blocks sorted by their last position, longest context first.
    order = jnp.argsort(-jnp.max(block_pos, axis=1)).astype(jnp.int32)          # [NB]
    sorted_at = jnp.zeros_like(order).at[order].set(block)                      # [NB]
    seq, _, valid = token_positions(query_start, kv_lens, num_seqs, num_tokens)
    offset = jnp.arange(num_tokens, dtype=jnp.int32) - query_start[seq]         # [T]
    row_slot = sorted_at[jnp.minimum(block_start[seq] + offset // rows, num_blocks - 1)]
    row_slot = row_slot * rows + offset % rows
    return ReferencePlan(block_seq=block_seq[order],
                         block_rows=jnp.where(real_slot, block_rows, 0)[order].astype(jnp.int32),
                         block_pos=block_pos[order].astype(jnp.int32),
                         row_slot=jnp.where(valid, row_slot, 0).astype(jnp.int32),
                         valid=valid)


def token_positions(query_start, kv_lens, num_seqs, num_tokens):
    """Per query row: (sequence index, absolute position, is-real-token)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)                        # [T]
    num_seqs_max = kv_lens.shape[0]
    seq = jnp.searchsorted(query_start, rows, side="right",
                           method="compare_all").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_seqs_max - 1)                              # [T]
    q_lens = query_start[1:] - query_start[:-1]                           # [S]
    pos = kv_lens[seq] - q_lens[seq] + (rows - query_start[seq])          # [T]
    valid = rows < query_start[jnp.clip(num_seqs, 0, num_seqs_max)]       # [T]
    return seq, pos.astype(jnp.int32), valid


def _attend_blocks(q, pos, pages, k_pages, v_pages, k_scale, v_scale, sm_scale):
    """Query blocks, each over its own sequence's pages. q: [NB, B, N, H] (float32);
    pos: int32[NB, B] (-1: no row); pages: int32[NB, pages_per_seq] -> [NB, B, N, H]."""
    num_blocks, rows, num_q_heads, head_dim = q.shape
    num_pages_per_seq = pages.shape[1]
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    chunk_pages = min(_CHUNK_PAGES, num_pages_per_seq)
    num_chunks = -(-num_pages_per_seq // chunk_pages)
    pages = jnp.pad(pages, ((0, 0), (0, num_chunks * chunk_pages - num_pages_per_seq)))
    chunk_len = chunk_pages * page_size
    # [NB, K, B*G, H]: a block's rows and a kv head's group share that head's keys.
    qg = q.reshape(num_blocks, rows, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(num_blocks, num_kv_heads, rows * group, head_dim)
    last = jnp.max(pos, axis=1)                                           # [NB]
    hi = jax.lax.Precision.HIGHEST

    def chunk(c, carry):
        row_max, denom, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(pages, c * chunk_pages, chunk_pages, axis=1)
        # Gather in the stored dtype (cheap), dequantise after.
        k = _dequant(k_pages[ids], k_scale).reshape(num_blocks, chunk_len, num_kv_heads, -1)
        v = _dequant(v_pages[ids], v_scale).reshape(num_blocks, chunk_len, num_kv_heads, -1)
        key_pos = c * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [C]
        # Slots past a block's last position may hold anything (stale, NaN). Their scores
        # are masked (a NaN score becomes -inf); their values are zeroed so that
        # 0 * NaN never reaches the output.
        seen = key_pos[None, :] <= last[:, None]                          # [NB, C]
        v = jnp.where(seen[:, :, None, None], v, 0.0)                     # [NB, C, K, H]
        mask = key_pos[None, None, :] <= pos[:, :, None]                  # [NB, B, C]
        mask = jnp.repeat(mask, group, axis=1)[:, None]                   # [NB, 1, B*G, C]
        scores = jnp.einsum("bkmh,bckh->bkmc", qg, k, precision=hi) * sm_scale
        scores = jnp.where(mask, scores, -jnp.inf)                        # [NB, K, B*G, C]
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))          # [NB, K, B*G]
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(scores - safe_max[..., None])
        rescale = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max - safe_max, -jnp.inf))
        denom = denom * rescale + jnp.sum(probs, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("bkmc,bckh->bkmh", probs, v, precision=hi)
        return new_max, denom, acc

    init = (jnp.full(qg.shape[:3], -jnp.inf), jnp.zeros(qg.shape[:3]), jnp.zeros(qg.shape))
    trips = jnp.minimum(jnp.maximum(jnp.max(last), 0) // chunk_len + 1, num_chunks)
    _, denom, acc = jax.lax.fori_loop(0, trips, chunk, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]               # [NB, K, B*G, H]
    out = out.reshape(num_blocks, num_kv_heads, rows, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_blocks, rows, num_q_heads, head_dim)


def ragged_paged_attention_reference(
        q: Float[ArrayLike, "T N H"], k_pages: Shaped[ArrayLike, "P L K H"],
        v_pages: Shaped[ArrayLike, "P L K H"], kv_lens: Int[ArrayLike, " S"],
        page_table: Int[ArrayLike, "S pages_per_seq"], query_start: Int[ArrayLike, " S+1"],
        num_seqs: Int[ArrayLike, ""], *, sm_scale, k_scale: Float[ArrayLike, " K"] | None = None,
        v_scale: Float[ArrayLike, " K"] | None = None, plan: ReferencePlan | None = None,
        interpret=False, **block_sizes) -> Float[Array, "T N H"]:
    """Causal attention of ragged query rows over a paged KV cache, in plain jnp.

    q: [T, N, H]; k_pages, v_pages: [P, L, K, H]; kv_lens: int32[S];
    page_table: int32[S, pages_per_seq]; query_start: int32[S+1]; num_seqs: int32 scalar.
    k_scale, v_scale: float32[K] dequantisation scales for fp8/int8 pages, or None.
    `plan` (plan_attention_reference) is built once per step and shared by the layers.
    `interpret` and `block_sizes` are accepted only so it can stand in for the kernel.
    Returns [T, N, H] in q's dtype; padding rows are zero.
    """
    del interpret, block_sizes
    q, k_pages, v_pages, kv_lens, page_table, query_start = map(
        jnp.asarray, (q, k_pages, v_pages, kv_lens, page_table, query_start))
    num_tokens = q.shape[0]
    if plan is None:
        plan = plan_attention_reference(query_start, kv_lens, num_seqs, num_tokens=num_tokens)
    num_blocks, rows = plan.block_rows.shape
    qb = q.astype(jnp.float32)[plan.block_rows]                           # [NB, B, N, H]
    pages = page_table[plan.block_seq]                                    # [NB, pages]
    attend = lambda args: _attend_blocks(*args, k_pages, v_pages, k_scale, v_scale, sm_scale)
    groups = max(_GROUPS if num_blocks >= 4 * _GROUPS else 1, -(-num_blocks // _MAX_BLOCKS))
    if groups == 1:
        out = attend((qb, plan.block_pos, pages))
    else:  # plan order: the groups' contexts shrink from the first to the last
        size = -(-num_blocks // groups)
        pad = groups * size - num_blocks
        grouped = lambda x, fill: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1),
                                          constant_values=fill).reshape(groups, size,
                                                                        *x.shape[1:])
        out = jax.lax.map(attend, (grouped(qb, 0), grouped(plan.block_pos, -1),
                                   grouped(pages, 0)))
    out = out.reshape(-1, *q.shape[1:])[plan.row_slot]                    # [T, N, H]
    return jnp.where(plan.valid[:, None, None], out, 0.0).astype(q.dtype)
