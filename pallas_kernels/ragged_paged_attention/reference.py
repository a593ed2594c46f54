"""Plain-jnp ragged paged attention: the correctness oracle and the CPU implementation."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from pallas_kernels.array_types import Array, Float, Int, Shaped

# Tokens are processed in blocks of this many rows so a long prefill chunk never
# materialises its whole [T, C, K, H] key gather at once.
_TOKEN_BLOCK = 128
# Pages of keys per online-softmax step.
_CHUNK_PAGES = 8


def _dequant(pages, scale):
    """[P, L, K, H] stored pages -> float32 values (scale: float32[K] or None)."""
    values = pages.astype(jnp.float32)
    if scale is not None:
        values = values * scale.astype(jnp.float32)[None, None, :, None]
    return values


def _attend_block(q, seq, pos, valid, k_pages, v_pages, page_table, k_scale, v_scale,
                  sm_scale):
    """One block of query rows. q: [B, N, H]; seq, pos: int32[B]; valid: bool[B].

    Keys are visited in chunks of `_CHUNK_PAGES` pages with an online softmax, and only
    up to the furthest position a row of the block attends to (a dynamic trip count):
    the cost follows the real context, not the page table's static width."""
    num_rows, num_q_heads = q.shape[:2]
    num_pages_per_seq = page_table.shape[1]
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    chunk_pages = min(_CHUNK_PAGES, num_pages_per_seq)
    num_chunks = -(-num_pages_per_seq // chunk_pages)
    pages = jnp.pad(page_table[seq], ((0, 0), (0, num_chunks * chunk_pages - num_pages_per_seq)))
    chunk_len = chunk_pages * page_size
    qg = q.astype(jnp.float32).reshape(num_rows, num_kv_heads, group, -1)   # [B, K, G, H]
    hi = jax.lax.Precision.HIGHEST

    def chunk(c, carry):
        row_max, denom, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(pages, c * chunk_pages, chunk_pages, axis=1)
        # Gather in the stored dtype (cheap), dequantise after.
        k = _dequant(k_pages[ids], k_scale).reshape(num_rows, chunk_len, num_kv_heads, -1)
        v = _dequant(v_pages[ids], v_scale).reshape(num_rows, chunk_len, num_kv_heads, -1)
        key_pos = c * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [C]
        mask = key_pos[None, :] <= pos[:, None]                            # [B, C]
        # Slots past a row's position may hold anything (stale, NaN): zero them so that
        # 0 * NaN never reaches the output.
        k = jnp.where(mask[:, :, None, None], k, 0.0)                     # [B, C, K, H]
        v = jnp.where(mask[:, :, None, None], v, 0.0)
        scores = jnp.einsum("bkgh,bckh->bkgc", qg, k, precision=hi) * sm_scale
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)      # [B, K, G, C]
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))          # [B, K, G]
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(scores - safe_max[..., None])                     # [B, K, G, C]
        rescale = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max - safe_max, -jnp.inf))
        denom = denom * rescale + jnp.sum(probs, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("bkgc,bckh->bkgh", probs, v, precision=hi)
        return new_max, denom, acc

    furthest = jnp.max(jnp.where(valid, pos, 0))
    init = (jnp.full(qg.shape[:3], -jnp.inf), jnp.zeros(qg.shape[:3]), jnp.zeros(qg.shape))
    _, denom, acc = jax.lax.fori_loop(0, jnp.minimum(furthest // chunk_len + 1, num_chunks),
                                      chunk, init)
    out = (acc / jnp.where(denom > 0, denom, 1.0)[..., None]).reshape(q.shape)  # [B, N, H]
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReferencePlan:
    """Per query row of a step: its sequence, absolute position, and whether it is real."""
    seq: jax.Array    # int32[T]
    pos: jax.Array    # int32[T]
    valid: jax.Array  # bool[T]


def plan_attention_reference(query_start, kv_lens, num_seqs, *, num_tokens, num_q_heads=None,
                             num_kv_heads=None, head_dim=None, block_q=None,
                             num_splits=None) -> ReferencePlan:
    """The reference's per-step plan; same signature as the kernel's `plan_attention`."""
    del num_q_heads, num_kv_heads, head_dim, block_q, num_splits
    return ReferencePlan(*token_positions(jnp.asarray(query_start), jnp.asarray(kv_lens),
                                          num_seqs, num_tokens))


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
    seq, pos, valid = plan.seq, plan.pos, plan.valid
    attend = lambda args: _attend_block(*args, k_pages, v_pages, page_table, k_scale,
                                        v_scale, sm_scale)
    if num_tokens <= _TOKEN_BLOCK:
        return attend((q, seq, pos, valid))
    num_blocks = -(-num_tokens // _TOKEN_BLOCK)
    pad = num_blocks * _TOKEN_BLOCK - num_tokens
    blocked = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(
        num_blocks, _TOKEN_BLOCK, *x.shape[1:])
    out = jax.lax.map(attend, (blocked(q), blocked(seq), blocked(pos), blocked(valid)))
    return out.reshape(-1, *q.shape[1:])[:num_tokens]
