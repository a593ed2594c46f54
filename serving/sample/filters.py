"""Top-k, top-p and min-p on the device: each row looks at its 64 most likely tokens,
then at 1,024, then (a flat distribution, a top-k past them) at thresholds over the whole
vocabulary (`vocab_threshold`), and draws from what it keeps (docs/architecture.md,
"Sampling"). `sa` is the step's `sampler.SamplingArrays` (not imported: the sampler
imports this module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.sample.device_branches import skippable
from serving.sample.draw import gumbel_max, softmax_draw
from serving.sample.vocab_blocks import block_top_k
from serving.sample.vocab_threshold import top_k_mask, top_p_mask

NUM_CANDIDATES = 1024  # the most likely tokens that top-k / top-p / min-p look at first
NUM_FEW_CANDIDATES = 64  # ... and before them: enough for common top-k and peaked top-p


def _keep(sorted_logits, log_normalizer, sa):
    """Top-k, then top-p and min-p over a row's tokens sorted most likely first (all of
    them or a prefix): the logits kept (-inf elsewhere), the probabilities, and each
    token's `above`: the mass of the tokens more likely than it. Top-p keeps a token
    when that is below top_p, so a tie is kept or dropped whole (as
    `vocab_threshold.top_p_mask` keeps it)."""
    width = sorted_logits.shape[-1]
    rank = jnp.arange(width)[None, :]
    masked = jnp.where((rank < sa.top_k[:, None]) | (sa.top_k[:, None] <= 0), sorted_logits,
                       -jnp.inf)
    probs = jnp.exp(masked - log_normalizer[:, None])
    before = jnp.cumsum(probs, axis=-1) - probs  # mass before each token, ties' included
    first = jnp.concatenate([jnp.ones_like(masked[:, :1], bool),
                             masked[:, 1:] != masked[:, :-1]], axis=-1)  # a tie's first
    above = jax.lax.cummax(jnp.where(first, before, 0.0), axis=1)  # `before` never falls
    keep = (above < sa.top_p[:, None]) & (probs >= sa.min_p[:, None] * probs[:, :1])
    return jnp.where(keep | (rank == 0), masked, -jnp.inf), probs, above


def _choose(kept, ids, sa):
    """Gumbel-max over the kept candidates (noise by token id: the same in every path)."""
    return gumbel_max(kept, ids, sa.seed, sa.output_index)


def _sorted_sample(scaled, sa):
    """Filters over the whole sorted vocabulary (the fallback: a full sort per row)."""
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, scaled.shape[-1])  # [S, V] descending
    masked = jnp.where((jnp.arange(scaled.shape[-1])[None, :] < sa.top_k[:, None])
                       | (sa.top_k[:, None] <= 0), sorted_logits, -jnp.inf)
    kept, _, _ = _keep(sorted_logits, jax.nn.logsumexp(masked, axis=-1), sa)
    return _choose(kept, sorted_ids, sa)


def filtered_sample(scaled, sa, rows):
    """Top-k, then top-p and min-p; a draw from what is kept. `rows`: the rows whose
    token counts. Each row looks at its NUM_FEW_CANDIDATES most likely tokens first, then
    at NUM_CANDIDATES (partial top-k, not a sort of the vocabulary), and takes the first
    of them that decides it: top-k within them, or they hold top-p's mass, or the last is
    below min-p's floor; Gumbel-max over what is kept. A row neither decides (a flat
    distribution, a top-k past them) gets its thresholds over the whole vocabulary
    (`_threshold_sample`). Each part runs only when some row needs it, and a row's path
    (so its token) depends on that row alone. A vocabulary of at most NUM_CANDIDATES
    tokens is sorted."""
    if scaled.shape[-1] <= NUM_CANDIDATES:
        return _sorted_sample(scaled, sa)

    few, few_ids, few_decided, few_probs = _candidates(scaled, sa, NUM_FEW_CANDIDATES)
    token = _choose(few, few_ids, sa)
    # Rows the wider candidates might decide: top-k within them, min-p, or a top-p that
    # their mass could reach (each token past the few at most as likely as the last).
    reach = jnp.sum(few_probs, axis=-1) + (NUM_CANDIDATES - NUM_FEW_CANDIDATES) * few_probs[:, -1]
    maybe = ((sa.top_k > NUM_FEW_CANDIDATES) & (sa.top_k <= NUM_CANDIDATES)) | (
        (sa.top_k <= 0) & ((sa.min_p > 0) | (reach * (1 + 1e-3) >= sa.top_p)))

    def wider():
        kept, ids, decided, _ = _candidates(scaled, sa, NUM_CANDIDATES)
        return jnp.where(decided, _choose(kept, ids, sa), -1)

    def rest():  # rows neither decides: the whole vocabulary
        wide = jax.lax.cond(jnp.any(maybe & ~few_decided & rows), wider,
                            lambda: jnp.full_like(token, -1))
        wide = jnp.where(few_decided, token, wide)
        return jax.lax.cond(jnp.all((wide >= 0) | ~rows), lambda: wide,
                            lambda: jnp.where(wide >= 0, wide, _threshold_sample(scaled, sa)))

    return jax.lax.cond(jnp.all(few_decided | ~rows), lambda: token, rest)


def few_candidates_sample(logits, divisor, sa):
    """For steps whose sampling rows all have a top-k within the NUM_FEW_CANDIDATES: the
    token `filtered_sample` draws for those rows from `logits / divisor`, without
    dividing the vocabulary (`block_top_k`'s divisor) or a pass over it for a normaliser
    (top-p and min-p read the top k). Other rows' tokens here mean nothing."""
    top_logits, top_ids = block_top_k(logits, NUM_FEW_CANDIDATES, divisor)
    inside = jnp.arange(NUM_FEW_CANDIDATES)[None, :] < sa.top_k[:, None]
    normalizer = jax.nn.logsumexp(jnp.where(inside, top_logits, -jnp.inf), axis=-1)
    kept, _, _ = _keep(top_logits, normalizer, sa)
    return _choose(kept, top_ids, sa)


def _candidates(scaled, sa, width: int = NUM_CANDIDATES):
    """The `width` most likely tokens of each row: what the filters keep of them, their
    ids, whether they decide the row (nothing past them could be kept), and their
    probabilities."""
    top_logits, top_ids = block_top_k(scaled, width)
    k_inside = (sa.top_k > 0) & (sa.top_k <= width)
    topk_masked = jnp.where(jnp.arange(width)[None, :] < sa.top_k[:, None], top_logits,
                            -jnp.inf)
    # The distribution top-p and min-p read: over the top k tokens, or the whole vocabulary.
    # (The whole-vocabulary pass only when some row has no top-k within the candidates;
    # jax.nn.logsumexp's, but the max is the candidates', not a pass of its own. Not
    # top_logits[:, 0]: a second slice of top_k's sort keeps XLA from making it a TopK.)
    top = jnp.max(top_logits, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    whole = skippable(jnp.all(k_inside), lambda: jnp.zeros(scaled.shape[0], scaled.dtype),
                      lambda: (jnp.log(jnp.sum(jnp.exp(scaled - top), axis=-1)) + top[:, 0]))
    normalizer = jnp.where(k_inside, jax.nn.logsumexp(topk_masked, axis=-1), whole)
    kept, probs, above = _keep(top_logits, normalizer, sa)
    # Top-p: the last candidate is dropped (so is any token past it, as likely or less).
    decided = k_inside | ((sa.top_k <= 0) & (
        ((sa.top_p < 1) & (above[:, -1] >= sa.top_p))
        | ((sa.min_p > 0) & (probs[:, -1] < sa.min_p * probs[:, 0]))))
    return kept, top_ids, decided, probs


def _threshold_sample(scaled, sa):
    """A draw (`softmax_draw`) from what `_threshold_kept` keeps."""
    kept = _threshold_kept(scaled, sa)
    return softmax_draw(jnp.where(kept, scaled, -jnp.inf), sa.seed, sa.output_index)


def _threshold_kept(scaled, sa):
    """bool[R, V]: top-k, then top-p and min-p over the whole vocabulary by thresholds
    (`vocab_threshold`: radix selects, no sort): the tokens `_keep` keeps, up to float32
    rounding of the sums at top-p's edge."""
    vocab = scaled.shape[-1]
    wide_k = (sa.top_k > 0) & (sa.top_k < vocab)
    every = jnp.ones(scaled.shape, bool)
    in_top_k = jax.lax.cond(jnp.any(wide_k),
                            lambda: top_k_mask(scaled, jnp.where(wide_k, sa.top_k, 0)),
                            lambda: every)
    # each token's weight relative to the most likely (always in the top k): in [0, 1]
    top = jnp.max(scaled, axis=-1, keepdims=True)
    weight = jnp.where(in_top_k, jnp.exp(scaled - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    cut = sa.top_p < 1
    in_top_p = jax.lax.cond(jnp.any(cut), lambda: top_p_mask(weight, sa.top_p) | ~cut[:, None],
                            lambda: every)
    return in_top_k & in_top_p & (weight >= sa.min_p[:, None])
