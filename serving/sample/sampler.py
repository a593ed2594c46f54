"""Sampling on device: penalties, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Every sequence draws from a hash of (seed, output index) (draw.py), so a
seeded request samples the same tokens whatever else shares its batch, and again after
a preemption recomputes it. Logprobs are of the raw model distribution (vLLM's default).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from serving.core.request import SAMPLING_EPS
from serving.sample.device_branches import cpu_else, skippable
from serving.sample.draw import softmax_draw
from serving.sample.filters import (
    NUM_CANDIDATES,
    NUM_FEW_CANDIDATES,
    few_candidates_sample,
    filtered_sample,
)
from serving.sample.sampling_arrays import (
    NUM_TOP_LOGPROBS,
    PENDING_TOKEN,
    SamplerOutput,
    SamplingArrays,
    TokenLogprobs,
)
from serving.sample.vocab_blocks import block_argmax, block_top_k


def _apply_penalties(logits, sa: SamplingArrays):
    """vLLM semantics: repetition over prompt+output, presence/frequency over output."""
    num_seqs, vocab = logits.shape
    tokens = jnp.asarray(sa.penalty_tokens)  # [S, W]
    if sa.pending_tokens is not None:
        tokens = jnp.where(tokens == PENDING_TOKEN, sa.pending_tokens[:, None], tokens)
    is_output = jnp.arange(tokens.shape[1])[None, :] >= sa.num_prompt_tokens[:, None]
    rows = jnp.broadcast_to(jnp.arange(num_seqs)[:, None], tokens.shape)
    safe = jnp.where(tokens >= 0, tokens, vocab)  # -1 padding -> dropped index
    seen = jnp.zeros((num_seqs, vocab), jnp.bool_).at[rows, safe].set(True, mode="drop")
    counts = jnp.zeros((num_seqs, vocab), jnp.float32).at[rows, safe].add(
        is_output.astype(jnp.float32), mode="drop")  # [S, V] output counts
    rep = sa.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sa.frequency_penalty[:, None] * counts
    return logits - sa.presence_penalty[:, None] * (counts > 0)


def _random_sample(scaled, sa: SamplingArrays):
    """A draw from each row's softmax(scaled) (logits / temperature). Rows that filter
    (top-k, top-p, min-p) go through `filtered_sample` (serving/sample/filters.py), the
    others through `softmax_draw`; each part runs only when some random row needs it. A row's token
    never depends on the other rows (same noise, same kept set)."""
    random_rows = sa.temperature >= SAMPLING_EPS
    filters = (sa.top_k > 0) | (sa.top_p < 1) | (sa.min_p > 0)
    none = jnp.zeros(scaled.shape[0], jnp.int32)
    filtered = jax.lax.cond(jnp.any(filters & random_rows),
                            lambda: filtered_sample(scaled, sa, filters & random_rows),
                            lambda: none)
    plain = skippable(jnp.any(~filters & random_rows),
                       lambda: softmax_draw(scaled, sa.seed, sa.output_index), lambda: none)
    return jnp.where(filters, filtered, plain)


def apply_token_mask(logits, bits):
    """Disallowed tokens -> -inf. bits: int32[S, W], bit v % 32 of word v // 32 set when
    token v is allowed (llguidance's layout)."""
    num_seqs, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).reshape(num_seqs, -1)[:, :vocab]  # [S, V]
    return jnp.where(allowed == 1, logits, -jnp.inf)


def _logprobs(take, tokens) -> TokenLogprobs:
    """The raw distribution's logprobs of some rows (take(): their logits)."""
    return token_logprobs(jax.nn.log_softmax(take(), axis=-1), tokens)


def token_logprobs(logprobs: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """logprobs: f32[R, V] (log-softmax); tokens: int[R] -> each row's chosen token's
    logprob and rank, and the row's NUM_TOP_LOGPROBS most likely tokens."""
    token_lp = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    # lax.top_k's values, ids and tie order through block maxima (~4x cheaper on CPU)
    top_logprobs, top_ids = block_top_k(logprobs, min(NUM_TOP_LOGPROBS, logprobs.shape[-1]))
    rank = 1 + jnp.sum(logprobs > token_lp[:, None], axis=-1)
    return TokenLogprobs(logprob=token_lp, rank=rank.astype(jnp.int32),
                         top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)


# The step's sampler path, chosen on the device from the step's rows (`_path`).
GREEDY, GENERAL, GREEDY_LOGPROBS, FEW, FEW_LOGPROBS = range(5)


def _path(sa: SamplingArrays, vocab: int):
    """GREEDY: the argmax alone (no row samples or edits its logits). FEW: every sampling
    row has a top-k within the few candidates and no row has edits (Qwen3's recommended
    settings: top-k 20): the few candidates decide every row, with no branch of their
    own. Each of them _LOGPROBS when some row asks for logprobs. GENERAL: the rest, each
    part under its own cond."""
    random_rows = sa.temperature >= SAMPLING_EPS
    few = (vocab > NUM_CANDIDATES) & ~_edits(sa) & jnp.all(
        ~random_rows | ((sa.top_k > 0) & (sa.top_k <= NUM_FEW_CANDIDATES)))
    base = jnp.where(~_special(sa), GREEDY, jnp.where(few, FEW, GENERAL))
    with_logprobs = jnp.where(base == GREEDY, GREEDY_LOGPROBS,
                              jnp.where(base == FEW, FEW_LOGPROBS, GENERAL))
    return jnp.where(sa.want_logprobs, with_logprobs, base)


def sample(logits: jax.Array, sa: SamplingArrays) -> SamplerOutput:
    """logits: f32[S, V] -> sampled ids and logprobs of the raw distribution.

    One `lax.switch` picks the step's path (`_path`): a greedy step is the argmax, a step
    whose sampling rows all have a small top-k the few candidates' draw, each with the
    logprobs when some row asks; in the general path each part runs under its own
    `lax.cond`, only in steps where some row needs it: the grammar mask (structured
    outputs), the min_tokens block, penalties, random sampling, logprobs (off the CPU,
    branches of a pass or two run always instead: `skippable`). So a greedy step and a
    step of Qwen3's recommended sampling, with logprobs or without, run one conditional
    (on a GPU each is a round trip to the host). On CPU the [S, V] passes take
    CPU_ROW_CHUNK rows at a time: their temporaries would otherwise grow the step's
    scratch buffer (one allocation, sized for every branch) past what the allocator
    reuses, and every step, greedy ones too, would page-fault ~S * V * 4 bytes afresh."""
    num_seqs, vocab = logits.shape
    num_top = min(NUM_TOP_LOGPROBS, vocab)

    def rows(take, sa):
        """The general path for some rows (their tokens never depend on the other rows')."""
        # (Off the CPU no cond: a row without edits or temperature picks the argmax of
        # its logits / 1, the same token.)
        token = cpu_else(lambda: jax.lax.cond(_special(sa), lambda: _processed(take, sa),
                                               lambda: block_argmax(take())),
                          lambda: _processed(take, sa))
        # Log-softmax and the top-20 of the raw distribution, only when some row asked.
        logprobs = jax.lax.cond(sa.want_logprobs, lambda: _logprobs(take, token),
                                lambda: _no_logprobs(token.shape[0], num_top))
        return token, logprobs

    def chunked(fn, per_row):
        """fn(take, per_row's rows) over CPU_ROW_CHUNK rows at a time on CPU."""
        return jax.lax.platform_dependent(
            cpu=lambda: _by_row_chunks(fn, CPU_ROW_CHUNK, logits, per_row),
            default=lambda: _by_row_chunks(fn, num_seqs, logits, per_row))

    def few_tokens():  # all rows at once: no [S, V] temporaries to bound
        # (A greedy row's logits are divided by 1: the argmax of its raw logits.)
        return _with_greedy_rows(logits, sa, few_candidates_sample(logits, _divisor(sa), sa))

    def without_logprobs(tokens):
        return lambda: (tokens(), _no_logprobs(num_seqs, num_top))

    def with_logprobs(tokens):
        def path():
            token = tokens()
            return token, chunked(_logprobs, token)
        return path

    greedy_tokens = lambda: block_argmax(logits)
    paths = [without_logprobs(greedy_tokens), lambda: chunked(rows, sa),
             with_logprobs(greedy_tokens)]
    if vocab > NUM_CANDIDATES:
        paths += [without_logprobs(few_tokens), with_logprobs(few_tokens)]
    token, logprobs = jax.lax.switch(_path(sa, vocab), paths)
    return SamplerOutput(token_ids=token, logprobs=logprobs)


def _edits(sa: SamplingArrays):
    """Whether some row's logits change before its pick: mask, min_tokens, penalties."""
    masked = jnp.bool_(False) if sa.token_mask is None else sa.token_mask.active
    return masked | jnp.any((sa.blocked_ids >= 0).any(axis=-1) | _penalized(sa))


def _penalized(sa: SamplingArrays):
    return ((sa.presence_penalty != 0) | (sa.frequency_penalty != 0)
            | (sa.repetition_penalty != 1))


def _special(sa: SamplingArrays):
    """Whether some row needs more than the argmax of its raw logits."""
    return _edits(sa) | jnp.any(sa.temperature >= SAMPLING_EPS)


CPU_ROW_CHUNK = 2  # rows per pass of the sampler's branches on CPU (see `sample`)


def _by_row_chunks(fn, chunk: int, logits, sa: SamplingArrays):
    """fn(take, sa's rows) over `chunk` rows at a time (a scan; one pass when chunk
    covers every row); scalars of sa go to every pass. take() returns the rows' logits:
    called inside the branches that read them, so that the slice fuses into their first
    pass instead of being copied out for every branch."""
    num_rows = logits.shape[0]
    chunk = np.gcd(num_rows, chunk)
    if chunk == num_rows:
        return fn(lambda: logits, sa)
    num_chunks = num_rows // chunk
    split = jax.tree.map(lambda a: a.reshape(num_chunks, chunk, *a.shape[1:]) if a.ndim
                         else jnp.broadcast_to(a, (num_chunks,)), sa)

    def one_chunk(start, rows_sa):  # the offset rides in the carry: a scalar in the body
        return start + chunk, fn(lambda: jax.lax.dynamic_slice_in_dim(logits, start, chunk),
                                 rows_sa)

    _, out = jax.lax.scan(one_chunk, jnp.int32(0), split)
    return jax.tree.map(lambda a: a.reshape(num_rows, *a.shape[2:]), out)


def _divisor(sa: SamplingArrays):
    """f32[S, 1]: each row's temperature, 1 for greedy rows."""
    return jnp.where(sa.temperature < SAMPLING_EPS, 1.0, sa.temperature)[:, None]


def _processed(take, sa: SamplingArrays):
    """Each row's pick from its logits (take()) divided by its temperature (greedy rows:
    by 1), after the grammar mask, the min_tokens block and penalties where a row has
    one. Either way the logits are read and divided in one pass, with no copy of them."""
    divisor = _divisor(sa)
    scaled = jax.lax.cond(_edits(sa), lambda: _edited(take(), sa) / divisor,
                          lambda: take() / divisor)
    return _pick(scaled, sa)


def _edited(logits, sa: SamplingArrays):
    """The grammar mask, the min_tokens block and penalties."""
    num_seqs, vocab = logits.shape
    mask = sa.token_mask
    if mask is not None:
        logits = jax.lax.cond(mask.active, lambda: apply_token_mask(logits, mask.bits),
                              lambda: logits)
    rows = jnp.broadcast_to(jnp.arange(num_seqs)[:, None], sa.blocked_ids.shape)
    blocked = jnp.where(sa.blocked_ids >= 0, sa.blocked_ids, vocab)
    logits = logits.at[rows, blocked].set(-jnp.inf, mode="drop")
    return jax.lax.cond(jnp.any(_penalized(sa)), lambda: _apply_penalties(logits, sa),
                        lambda: logits)


def _pick(scaled, sa: SamplingArrays):
    """Greedy rows' argmax; random sampling only when some row samples."""
    return jax.lax.cond(
        jnp.all(sa.temperature < SAMPLING_EPS), lambda: block_argmax(scaled),
        lambda: _with_greedy_rows(scaled, sa, _random_sample(scaled, sa)))


def _with_greedy_rows(scaled, sa: SamplingArrays, drawn):
    """The greedy rows' argmax (computed only when some row is greedy), the others' draw."""
    greedy_rows = sa.temperature < SAMPLING_EPS
    greedy = skippable(jnp.any(greedy_rows), lambda: block_argmax(scaled),
                       lambda: jnp.zeros(scaled.shape[0], jnp.int32))
    return jnp.where(greedy_rows, greedy, drawn)


def _no_logprobs(num_rows: int, num_top: int) -> TokenLogprobs:
    return TokenLogprobs(logprob=jnp.zeros(num_rows, jnp.float32),
                         rank=jnp.zeros(num_rows, jnp.int32),
                         top_ids=jnp.zeros((num_rows, num_top), jnp.int32),
                         top_logprobs=jnp.zeros((num_rows, num_top), jnp.float32))
