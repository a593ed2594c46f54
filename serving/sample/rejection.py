"""Verifying draft tokens against the target model: lossless acceptance.

For each request with drafts d_1..d_k (from a proposer with distributions q_i; n-gram
drafts have none: q_i is one-hot at d_i) and the target's distributions p_1..p_{k+1} at
the k+1 verified positions: draft i is accepted with probability min(1, p_i(d_i) /
q_i(d_i)) while all before it were; at the first rejected position the token is drawn
from the normalised max(0, p_i - q_i); if all k are accepted, a bonus token is drawn
from p_{k+1}. The tokens emitted then follow the target's distribution exactly
(Leviathan et al., 2023; Chen et al., 2023). Greedy rows (p one-hot at its argmax)
reduce to: accept while the draft is the argmax, which the engine checks on the host for
n-gram drafts (serving/engine/speculation.py); this is the sampled rows' verification,
which the engine does not run yet.

The draws are the caller's: `uniforms` decide acceptance, `noise` (Gumbel, one row per
position) the resampled or bonus token, so a seeded request is reproducible.
"""

from __future__ import annotations

import jax.numpy as jnp


def rejection_sample(target_probs, draft_tokens, num_drafts, uniforms, noise,
                     draft_probs=None):
    """Accepted counts int32[R] and emitted tokens int32[R, K+1] (the first count + 1 are
    the row's output: its accepted drafts, then the resampled or bonus token).

    target_probs f32[R, K+1, V]; draft_tokens int32[R, K]; num_drafts int32[R] (a row's
    drafts past its count are ignored: 0 means a plain decode from target_probs[:, 0]);
    uniforms f32[R, K] in (0, 1); noise f32[R, K+1, V] (Gumbel); draft_probs f32[R, K, V]
    or None (one-hot drafts)."""
    num_rows, width, vocab = target_probs.shape
    k = width - 1
    positions = jnp.arange(k)[None, :]                                      # [1, K]
    drafts = jnp.clip(draft_tokens, 0, vocab - 1)
    p_draft = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        residual = target_probs[:, :k] * (1 - _one_hot(drafts, vocab))    # max(0, p - 1hot)
    else:
        q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        residual = jnp.maximum(target_probs[:, :k] - draft_probs, 0.0)
    accept = (uniforms * q_draft < p_draft) & (positions < num_drafts[:, None])  # [R, K]
    # accepted count: the leading run of accepted positions
    count = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [R]
    # the distribution at each position if it is the first not accepted: the residual
    # after a rejected draft, the target's own past the row's drafts (the bonus)
    has_draft = positions < num_drafts[:, None]
    fallback = jnp.where(has_draft[..., None], residual, target_probs[:, :k])
    dists = jnp.concatenate([fallback, target_probs[:, k:]], axis=1)        # [R, K+1, V]
    # a residual of zero mass (p == q at a rejected draft, a measure-zero event) falls
    # back to the target's distribution
    empty = jnp.sum(dists, axis=-1, keepdims=True) <= 0
    dists = jnp.where(empty, target_probs, dists)
    logs = jnp.where(dists > 0, jnp.log(jnp.where(dists > 0, dists, 1.0)), -jnp.inf)
    drawn = jnp.argmax(logs + noise, axis=-1).astype(jnp.int32)             # [R, K+1]
    padded = jnp.concatenate([drafts, jnp.zeros((num_rows, 1), jnp.int32)], axis=1)
    index = jnp.arange(width)[None, :]
    tokens = jnp.where(index < count[:, None], padded, drawn)
    tokens = jnp.where(index <= count[:, None], tokens, 0)
    return count.astype(jnp.int32), tokens.astype(jnp.int32)


def _one_hot(ids, vocab):
    return (ids[..., None] == jnp.arange(vocab)).astype(jnp.float32)


__all__ = ["rejection_sample"]
