"""The device sampler: greedy, temperature, top-k/top-p/min-p, penalties, seeds, logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.core.request import SamplingParams, uses_penalties
from serving.sample.sampler import sample
from serving.sample.sampling_arrays import SamplingEntry, build_sampling_arrays

_sample = jax.jit(sample)


def traced_afresh():
    """jit(sample) traced anew: `jax.jit(sample)` would reuse a trace made before a test
    patched what tracing reads (CPU_ROW_CHUNK, BRANCH_FREE_ON_CPU, lax.cond)."""
    return jax.jit(lambda logits, sa: sample(logits, sa))


def num_conds(logits, sa) -> int:
    """lax.cond / lax.switch equations in the sampler's jaxpr (nested ones included)."""
    return str(jax.make_jaxpr(lambda x, s: sample(x, s))(logits, sa)).count(" cond[")


def run(logits, params, *, output_index=0, seed=7, tokens=None, num_prompt=0, blocked=()):
    logits = np.asarray(logits, np.float32)
    entry = SamplingEntry(params, seed, output_index, blocked, tokens, num_prompt)
    entries = [entry] * logits.shape[0]
    arrays = build_sampling_arrays(entries, logits.shape[0], 16, logits.shape[1])
    return jax.device_get(_sample(logits, arrays))


def draws(logits, params, n=3000):
    """n independent draws for one row: a batch of n rows with distinct output indices."""
    logits = np.tile(np.asarray(logits, np.float32), (n, 1))
    entries = [SamplingEntry(params, 11, i, (), None, 0) for i in range(n)]
    arrays = build_sampling_arrays(entries, n, 16, logits.shape[1])
    return jax.device_get(_sample(logits, arrays)).token_ids


LOGITS = np.log(np.array([[0.5, 0.25, 0.15, 0.1]]))


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(3, 50))
    out = run(logits, SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draws(LOGITS, SamplingParams(temperature=1.0)), minlength=4) / 3000
    np.testing.assert_allclose(counts, [0.5, 0.25, 0.15, 0.1], atol=0.035)


def test_top_k_keeps_only_k_most_likely():
    tokens = draws(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert set(np.unique(tokens)) == {0, 1}
    np.testing.assert_allclose(np.mean(tokens == 0), 0.5 / 0.75, atol=0.035)


def test_top_p_keeps_smallest_prefix_reaching_p():
    tokens = draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 >= 0.7
    assert set(np.unique(tokens)) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max():
    tokens = draws(LOGITS, SamplingParams(temperature=1.0, min_p=0.35))  # keeps p >= 0.175
    assert set(np.unique(tokens)) == {0, 1}


def test_low_temperature_concentrates_on_argmax():
    tokens = draws(LOGITS, SamplingParams(temperature=0.05), n=500)
    assert np.all(tokens == 0)


def test_seed_and_output_index_determine_the_draw():
    logits = np.zeros((1, 1000))
    p = SamplingParams(temperature=1.0)
    a = run(logits, p, seed=1, output_index=3).token_ids
    assert run(logits, p, seed=1, output_index=3).token_ids == a
    others = {int(run(logits, p, seed=s, output_index=i).token_ids[0])
              for s, i in [(2, 3), (1, 4), (3, 9)]}
    assert len(others | {int(a[0])}) > 1


def test_blocked_ids_are_never_sampled():
    logits = np.array([[5.0, 0.0, 0.0]])
    assert run(logits, SamplingParams(temperature=0.0), blocked=(0,)).token_ids[0] != 0


def test_penalties_match_vllm_formulas():
    logits = np.array([[2.0, -1.0, 0.5, 1.0]])
    # prompt = [1], outputs = [2, 2]: repetition hits 1 and 2, freq/presence only 2.
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.4,
                            presence_penalty=0.3)
    expected = np.array([2.0, -2.0, 0.25 - 0.8 - 0.3, 1.0])
    out = run(logits, params, tokens=[1, 2, 2], num_prompt=1)
    assert out.token_ids[0] == expected.argmax()
    logits2 = np.array([[1.0, 0.0, 1.2, 0.0]])  # without penalties token 2 would win
    assert run(logits2, params, tokens=[1, 2, 2], num_prompt=1).token_ids[0] == 0


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = np.random.default_rng(1).normal(size=(2, 30))
    out = run(logits, SamplingParams(temperature=0.0, logprobs=5))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs.logprob, ref.max(-1), atol=1e-5)
    np.testing.assert_array_equal(out.logprobs.rank, [1, 1])
    np.testing.assert_array_equal(out.logprobs.top_ids[:, :5], np.argsort(-ref, -1)[:, :5])
    np.testing.assert_allclose(out.logprobs.top_logprobs[:, :5], -np.sort(-ref, -1)[:, :5],
                               atol=1e-5)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2),
                                         ("min_p", 1.5), ("max_tokens", 0)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _mask(allowed_rows, vocab):
    """A TokenMask whose row i allows exactly allowed_rows[i] (None: every token)."""
    from serving.structured_output.token_mask import TokenMask, num_mask_words
    bits = np.full((len(allowed_rows), num_mask_words(vocab)), -1, np.int32)
    for i, allowed in enumerate(allowed_rows):
        if allowed is not None:
            row = np.zeros(num_mask_words(vocab) * 32, np.uint8)
            row[list(allowed)] = 1
            bits[i] = np.packbits(row, bitorder="little").view(np.int32)
    return TokenMask(np.array(True), bits)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=1.0, top_p=0.5, top_k=3)])
def test_token_mask_limits_constrained_rows_only(params):
    logits = np.random.default_rng(1).normal(size=(3, 70)).astype(np.float32)
    allowed = [{5, 33, 69}, None, {64}]  # tokens in the last, partly used mask word too
    entries = [SamplingEntry(params, 9, i, (), None, 0) for i in range(3)]
    masked = jax.device_get(_sample(logits, build_sampling_arrays(
        entries, 3, 16, 70, token_mask=_mask(allowed, 70))))
    plain = jax.device_get(_sample(logits, build_sampling_arrays(entries, 3, 16, 70)))
    assert masked.token_ids[0] in allowed[0] and masked.token_ids[2] == 64
    assert masked.token_ids[1] == plain.token_ids[1]  # an unconstrained row draws as before
    np.testing.assert_allclose(masked.logprobs.logprob[1], plain.logprobs.logprob[1])  # raw


def test_inactive_mask_changes_nothing():
    from serving.structured_output.token_mask import inactive_mask
    logits = np.random.default_rng(2).normal(size=(2, 40)).astype(np.float32)
    entries = [SamplingEntry(SamplingParams(temperature=1.0), 4, 0, (), None, 0)] * 2
    off = _mask([{1}, {2}], 40)
    off.active = np.array(False)  # the bits would force tokens 1 and 2, but are not applied
    np.testing.assert_array_equal(
        jax.device_get(_sample(logits, build_sampling_arrays(entries, 2, 16, 40,
                                                             token_mask=off))).token_ids,
        jax.device_get(_sample(logits, build_sampling_arrays(entries, 2, 16, 40))).token_ids)
    assert inactive_mask(2, 40).bits.shape == (2, 2)


def test_gumbel_uniforms_stay_strictly_inside_zero_one():
    from serving.sample.draw import gumbel_noise_at, uniform_from_bits
    extremes = np.array([0, 1, 0xFFFFFF00, 0xFFFFFFFF], np.uint32)
    u = np.asarray(uniform_from_bits(extremes))
    assert (u > 0).all() and (u < 1).all()
    noise = np.asarray(gumbel_noise_at(np.arange(8, dtype=np.uint32), np.zeros(8, np.int32),
                                       np.arange(4096)[None, :]))
    assert np.isfinite(noise).all()


def test_softmax_draw_follows_the_softmax():
    """The temperature-only draw (a block by its mass, then a token within it) against the
    softmax's probabilities: a chi-square over 100,000 seeds on a ragged vocabulary (five
    full blocks and a padded one), masked tokens never drawn."""
    from serving.sample.draw import DRAW_BLOCK, softmax_draw
    vocab, num_draws, chunk = 5 * DRAW_BLOCK + 44, 100_000, 25_000
    logits = (np.random.default_rng(7).normal(size=vocab) * 1.5).astype(np.float32)
    logits[[7, DRAW_BLOCK + 1, vocab - 1]] = -np.inf
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    draw = jax.jit(softmax_draw)
    tokens = np.concatenate([np.asarray(draw(
        np.broadcast_to(logits, (chunk, vocab)), np.arange(start, start + chunk, dtype=np.uint32),
        np.full(chunk, 3, np.int32))) for start in range(0, num_draws, chunk)])
    counts = np.bincount(tokens, minlength=vocab)
    allowed = probs > 0
    assert counts[~allowed].sum() == 0
    expected = num_draws * probs[allowed]
    chi2, dof = ((counts[allowed] - expected) ** 2 / expected).sum(), allowed.sum() - 1
    assert abs(chi2 - dof) < 4 * np.sqrt(2 * dof), (chi2, dof)  # within 4 sd of its mean
    again = draw(np.broadcast_to(logits, (4, vocab)), np.arange(4, dtype=np.uint32),
                 np.full(4, 3, np.int32))
    np.testing.assert_array_equal(again, tokens[:4])  # a pure function of (seed, index)


def _sorted_kept(scaled, sa):
    """bool[R, V]: what the full sort's filters keep of each row's finite logits."""
    from serving.sample.filters import _keep
    vocab = scaled.shape[-1]
    sorted_logits, ids = jax.lax.top_k(scaled, vocab)
    masked = jnp.where((jnp.arange(vocab)[None, :] < sa.top_k[:, None]) | (sa.top_k[:, None] <= 0),
                       sorted_logits, -jnp.inf)
    kept = jnp.isfinite(_keep(sorted_logits, jax.nn.logsumexp(masked, axis=-1), sa)[0])
    return jnp.zeros(scaled.shape, bool).at[jnp.arange(scaled.shape[0])[:, None], ids].set(kept)


@pytest.mark.parametrize("peaked", [True, False])
def test_candidate_filtering_keeps_what_the_full_sort_keeps(peaked):
    """Over a vocabulary wider than NUM_CANDIDATES, rows the candidates decide (peaked
    logits, as a trained model's; top-k within them) draw the full sort's token; the
    others (flat logits: the candidates cannot hold top-p's mass; top-k past them) keep,
    by thresholds over the whole vocabulary, exactly the tokens the full sort keeps, and
    draw one of them."""
    from serving.sample.filters import (
        NUM_CANDIDATES,
        _candidates,
        _sorted_sample,
        _threshold_kept,
        filtered_sample,
    )
    vocab, rows = 3 * NUM_CANDIDATES + 5, 60
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(rows, vocab)) * (6.0 if peaked else 0.05)
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(top_k=50),
              SamplingParams(min_p=0.05), SamplingParams(top_k=40, top_p=0.5, min_p=0.01),
              SamplingParams(top_k=NUM_CANDIDATES + 500, top_p=0.95)]
    entries = [SamplingEntry(params[i % 5], 100 + i, i, (), None, 0) for i in range(rows)]
    sa = build_sampling_arrays(entries, rows, 16, vocab)
    scaled = np.asarray(logits / sa.temperature[:, None], np.float32)
    fast = jax.device_get(jax.jit(filtered_sample)(scaled, sa, np.ones(rows, bool)))
    full = jax.device_get(jax.jit(_sorted_sample)(scaled, sa))
    decided = np.asarray(jax.jit(_candidates)(scaled, sa)[2])
    np.testing.assert_array_equal(fast[decided], full[decided])
    assert len(set(fast.tolist())) > 1
    kept = np.asarray(jax.jit(_sorted_kept)(scaled, sa))
    np.testing.assert_array_equal(np.asarray(jax.jit(_threshold_kept)(scaled, sa))[~decided],
                                  kept[~decided])
    assert kept[np.arange(rows), fast].all()
    assert not decided[4::5].any()  # top-k past the candidates
    assert decided[:4].all() if peaked else not decided[::5].any()  # flat: top-p falls back
    if not peaked:
        assert kept[::5].sum(axis=-1).min() > NUM_CANDIDATES  # top-p's set is that wide


def test_top_k_mask_keeps_what_top_k_keeps():
    """The radix select's top k: lax.top_k's ids, ties broken towards the lower id, rows
    of -inf, k of 0 (off) and k past the vocabulary."""
    from serving.sample.vocab_threshold import top_k_mask
    vocab = 3000
    x = np.random.default_rng(9).integers(-3, 4, size=(6, vocab)).astype(np.float32)
    x[1, :] = -np.inf
    x[1, [5, 77]] = -2.5
    x[2] = np.random.default_rng(10).normal(size=vocab).astype(np.float32)
    x[3, ::2] = -0.0  # below 0.0, as lax.top_k orders them
    k = np.array([1, 5, 1700, 2999, 0, vocab + 4], np.int32)
    got = np.asarray(jax.jit(top_k_mask)(x, k))
    for row in range(6):
        want = np.zeros(vocab, bool)
        if 0 < k[row] < vocab:
            want[np.asarray(jax.lax.top_k(x[row], int(k[row]))[1])] = True
        else:
            want[:] = True
        np.testing.assert_array_equal(got[row], want, err_msg=f"row {row}")


def test_top_p_mask_keeps_the_smallest_most_likely_set_holding_p():
    """Against float64 sums: a token stays when the tokens more likely than it hold less
    than top_p; ties at the edge stay whole; top-p's edge found bit by bit."""
    from serving.sample.vocab_threshold import top_p_mask
    rng = np.random.default_rng(11)
    weights = np.exp(rng.normal(size=(5, 5000)) * np.array([[0.05], [1.0], [3.0], [0.0], [8.0]]))
    weights = (weights / weights.max(axis=-1, keepdims=True)).astype(np.float32)
    top_p = np.array([0.9, 0.5, 0.99, 0.3, 0.999], np.float32)
    got = np.asarray(jax.jit(top_p_mask)(weights, top_p))
    for row in range(5):
        w = weights[row].astype(np.float64)
        above = np.array([w[w > v].sum() for v in np.unique(w)])
        edge = np.unique(w)[above < top_p[row] * w.sum()].min()
        np.testing.assert_array_equal(got[row], w >= edge, err_msg=f"row {row}")
    assert got[3].all()  # a tie of every token


def test_a_rows_token_never_depends_on_its_neighbours():
    """Seeded rows of one step, flat (the whole-vocabulary thresholds) and peaked (the
    candidates), draw the same token alone as in CPU chunks beside the other kind."""
    import serving.sample.sampler as sampler
    from serving.sample.filters import NUM_CANDIDATES
    vocab = 3 * NUM_CANDIDATES + 5
    rng = np.random.default_rng(12)
    logits = (rng.normal(size=(6, vocab)) * np.array([[0.05], [6.0]] * 3)).astype(np.float32)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, top_k=2500, seed=3)]
    entries = [SamplingEntry(params[i // 2], 400 + i, 3, (), None, 0) for i in range(6)]
    sa = build_sampling_arrays(entries, 6, 16, vocab)
    assert sampler.CPU_ROW_CHUNK == 2  # each chunk: a flat row and a peaked one
    together = jax.device_get(_sample(logits, sa).token_ids)
    alone = [int(_sample(logits[i:i + 1], build_sampling_arrays(
        entries[i:i + 1], 1, 16, vocab)).token_ids[0]) for i in range(6)]
    np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("k,vocab", [(64, 100 * 128 + 37), (16, 70_000)])
def test_block_top_k_equals_top_k_with_ties_and_a_ragged_vocabulary(k, vocab):
    """Candidates found through block maxima (two levels of blocks) are lax.top_k's:
    values, ids, order (ties broken towards the lower id), also where the vocabulary is
    no multiple of the block and where whole blocks are -inf."""
    from serving.sample.vocab_blocks import block_top_k
    logits = np.random.default_rng(4).integers(0, 6, size=(6, vocab)).astype(np.float32)
    logits[1, :] = -np.inf
    logits[1, [3, 900, vocab - 1]] = 2.0
    logits[2, : vocab // 2] = -np.inf
    logits[3, :] = 1.0
    fast = jax.device_get(jax.jit(block_top_k, static_argnums=1)(logits, k))
    full = jax.device_get(jax.lax.top_k(logits, k))
    np.testing.assert_array_equal(fast[0], full[0])
    np.testing.assert_array_equal(fast[1], full[1])


def test_block_top_k_of_divided_logits_equals_top_k_of_the_division():
    """block_top_k(x, k, divisor) without dividing x gives lax.top_k(x / divisor, k):
    values, ids and order, also where the division rounds neighbouring values into ties
    that x does not have."""
    from serving.sample.vocab_blocks import block_top_k
    rng = np.random.default_rng(4)
    vocab = 100 * 128 + 37
    x = rng.integers(0, 7, size=(6, vocab)).astype(np.float32)
    top = rng.random(x.shape) < 0.004  # ~50 entries a row just under 8, a float or more apart
    x[top] = np.float32(7.99)
    for ulps in range(1, 4):
        x = np.where(top & (rng.integers(0, 4, size=x.shape) >= ulps),
                     np.nextafter(x, np.float32(np.inf)), x)
    # Quotients in a wider binade (their floats further apart) round neighbours together.
    divisor = np.array([[0.997], [0.7], [1.0], [0.996], [3.0], [0.998]], np.float32)
    full = jax.device_get(jax.jit(lambda x, d: jax.lax.top_k(x / d, 64))(x, divisor))
    assert (full[1] != jax.device_get(jax.lax.top_k(x, 64))[1]).any()  # ties of the division
    fast = jax.device_get(jax.jit(block_top_k, static_argnums=1)(x, 64, divisor))
    np.testing.assert_array_equal(fast[0], full[0])
    np.testing.assert_array_equal(fast[1], full[1])


def test_block_argmax_equals_argmax():
    """The first maximum, through block maxima: ties, -inf rows and blocks."""
    from serving.sample.vocab_blocks import ARGMAX_BLOCK, block_argmax
    vocab = 40 * ARGMAX_BLOCK
    logits = np.random.default_rng(8).integers(0, 4, size=(6, vocab)).astype(np.float32)
    logits[1, :] = -np.inf
    logits[2, : vocab - 3] = -np.inf
    logits[3, [17, 700]] = 9.0
    logits[4, vocab - 1] = 9.0  # the last token of the last block
    logits[5, :] = 0.0
    np.testing.assert_array_equal(jax.jit(block_argmax)(logits),
                                  jax.jit(lambda x: x.argmax(axis=-1))(logits))


@pytest.mark.parametrize("spread", [6.0, 1.0])
def test_few_candidates_draw_what_the_full_sort_draws(spread):
    """Over a vocabulary wide enough for the block search, rows decided by the few
    candidates (spread 6: peaked) and rows that need the wider ones (top-k 65) draw the
    full sort's tokens; rows neither decides (spread 1: top-p 0.9 needs more than 1,024
    tokens) draw one the full sort keeps."""
    from serving.sample.filters import (
        NUM_FEW_CANDIDATES,
        _candidates,
        _sorted_sample,
        filtered_sample,
    )
    vocab, rows = 40_000, 16
    logits = np.random.default_rng(5).normal(size=(rows, vocab)) * spread
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
              SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(min_p=0.1),
              SamplingParams(top_k=NUM_FEW_CANDIDATES + 1)]
    entries = [SamplingEntry(params[i % 4], 200 + i, i, (), None, 0) for i in range(rows)]
    sa = build_sampling_arrays(entries, rows, 16, vocab)
    scaled = np.asarray(logits / sa.temperature[:, None], np.float32)
    fast = jax.device_get(jax.jit(filtered_sample)(scaled, sa, np.ones(rows, bool)))
    full = jax.device_get(jax.jit(_sorted_sample)(scaled, sa))
    decided = np.asarray(jax.jit(_candidates, static_argnums=2)(scaled, sa,
                                                                NUM_FEW_CANDIDATES)[2])
    assert decided[::4].all() and not decided[3::4].any()  # top-k 50 inside, 65 not
    assert decided[1::4].all() if spread == 6.0 else not decided[1::4].any()
    wider = np.asarray(jax.jit(_candidates)(scaled, sa)[2])  # NUM_CANDIDATES
    np.testing.assert_array_equal(fast[wider], full[wider])
    # spread 1: top-p 0.9 needs more than NUM_CANDIDATES too (whole-vocabulary thresholds)
    assert wider.all() if spread == 6.0 else not wider[1::4].any()
    assert np.asarray(jax.jit(_sorted_kept)(scaled, sa))[np.arange(rows), fast].all()


def test_row_chunks_sample_what_one_pass_samples(monkeypatch):
    """On CPU the sampler's branches take CPU_ROW_CHUNK rows at a time; every row's token
    and logprobs are what one pass over all rows gives."""
    import serving.sample.sampler as sampler
    logits = np.random.default_rng(6).normal(size=(6, 3000)).astype(np.float32) * 4
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.9, top_p=0.8, top_k=20)]
    entries = [SamplingEntry(params[i % 3], 300 + i, i, (5,) if i == 4 else (), None, 0)
               for i in range(6)]
    sa = build_sampling_arrays(entries, 6, 16, 3000)
    chunked = jax.device_get(traced_afresh()(logits, sa))
    monkeypatch.setattr(sampler, "CPU_ROW_CHUNK", 6)
    whole = jax.device_get(traced_afresh()(logits, sa))
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(a, b)


def test_the_branch_free_form_samples_what_the_cpu_form_samples(monkeypatch, vocab=3000):
    """Off the CPU cheap branches run always behind a select (`device_branches.skippable`)
    instead of a lax.cond; every row's token and logprobs are the same, over a step mixing greedy,
    logprobs, temperature alone, top-k, peaked and flat top-p, min-p, penalties and a
    min_tokens block."""
    import serving.sample.device_branches as branches
    rng = np.random.default_rng(21)
    logits = (rng.normal(size=(10, vocab)) * np.array(
        [[4.0], [4.0], [1.0], [4.0], [6.0], [0.05], [3.0], [2.0], [4.0], [1.0]])
              ).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.8), SamplingParams(temperature=0.7, top_k=20),
              SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
              SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.4),
              SamplingParams(temperature=0.0, frequency_penalty=0.5),
              SamplingParams(temperature=1.0, top_p=0.8, min_tokens=4)]
    entries = [SamplingEntry(p, 50 + i, 2, (3, 7) if p.min_tokens else (),
                             [1, 2, 2, 5] if uses_penalties(p) else None, 2)
               for i, p in enumerate(params)]
    sa = build_sampling_arrays(entries, 10, 16, vocab)
    cpu_form = jax.device_get(traced_afresh()(logits, sa))
    cpu_conds = num_conds(logits, sa)
    for only in ([0, 1], [2, 3, 4, 5, 6, 9]):  # steps with fewer kinds of row
        part = build_sampling_arrays([entries[i] for i in only], len(only), 16, vocab)
        cpu_part = jax.device_get(traced_afresh()(logits[only], part))
        monkeypatch.setattr(branches, "BRANCH_FREE_ON_CPU", True)
        free_part = jax.device_get(traced_afresh()(logits[only], part))
        monkeypatch.setattr(branches, "BRANCH_FREE_ON_CPU", False)
        np.testing.assert_array_equal(free_part.token_ids, cpu_part.token_ids)
    monkeypatch.setattr(branches, "BRANCH_FREE_ON_CPU", True)
    free = jax.device_get(traced_afresh()(logits, sa))
    assert num_conds(logits, sa) < cpu_conds  # the other form was traced
    np.testing.assert_array_equal(free.token_ids, cpu_form.token_ids)
    for a, b in zip(jax.tree.leaves(free.logprobs), jax.tree.leaves(cpu_form.logprobs)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def executed_conditionals(monkeypatch, logits, params):
    """(output, how many lax.cond / lax.switch one sampler call runs) in the form a GPU
    gets (the branch-free form, one pass over the rows): every branch reports through a
    debug callback when it runs."""
    import serving.sample.device_branches as branches
    import serving.sample.sampler as sampler
    ran: list[int] = []
    cond, switch = jax.lax.cond, jax.lax.switch

    def reporting(branch):
        def run_branch(*operands):
            jax.debug.callback(lambda: ran.append(1))
            return branch(*operands)
        return run_branch

    with monkeypatch.context() as patched:
        patched.setattr(branches, "BRANCH_FREE_ON_CPU", True)
        patched.setattr(sampler, "CPU_ROW_CHUNK", logits.shape[0])
        patched.setattr(jax.lax, "cond", lambda pred, yes, no, *operands, **kw: cond(
            pred, reporting(yes), reporting(no), *operands, **kw))
        patched.setattr(jax.lax, "switch", lambda index, fns, *operands, **kw: switch(
            index, [reporting(fn) for fn in fns], *operands, **kw))
        out = jax.device_get(traced_afresh()(logits, arrays_for(params, logits)))
    jax.effects_barrier()
    return out, len(ran)


def arrays_for(params, logits):
    entries = [SamplingEntry(p, 9, 4 + i, (), None, 0) for i, p in enumerate(params)]
    return build_sampling_arrays(entries, len(params), 16, logits.shape[1])


def test_greedy_and_qwen3_recommended_steps_run_one_conditional(monkeypatch):
    """On a GPU each conditional a step runs is a round trip to the host. A greedy step
    runs one (the sampler's path), and so does a step of Qwen3's recommended sampling
    (temperature 0.6 / 0.7, top-p 0.95 / 0.8, top-k 20) beside greedy rows, with logprobs
    or without; they draw the tokens the general path draws, on the CPU too, and the
    logprobs are the raw distribution's."""
    from serving.sample.filters import NUM_CANDIDATES
    from serving.sample.sampler import token_logprobs
    vocab = 2 * NUM_CANDIDATES + 7
    logits = (np.random.default_rng(31).normal(size=(4, vocab)) * 3).astype(np.float32)
    greedy = [SamplingParams(temperature=0.0)] * 4
    qwen3 = [SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
             SamplingParams(temperature=0.7, top_p=0.8, top_k=20),
             SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=64)]

    def asking(params):
        return [SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                               logprobs=2) for p in params]

    raw = jax.nn.log_softmax(logits, axis=-1)
    for params in (greedy, qwen3):
        out, runs = executed_conditionals(monkeypatch, logits, params)
        assert runs == 1
        with_logprobs, runs = executed_conditionals(monkeypatch, logits, asking(params))
        assert runs == 1
        np.testing.assert_array_equal(with_logprobs.token_ids, out.token_ids)
        expected = jax.device_get(token_logprobs(raw, jnp.asarray(out.token_ids)))
        for a, b in zip(jax.tree.leaves(with_logprobs.logprobs), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.token_ids[2], logits[2].argmax())
    # The general path (a row without a top-k), its conds counted too: the same tokens.
    general = qwen3 + [SamplingParams(temperature=0.8, top_p=0.9)]
    logits5 = np.concatenate([logits, logits[:1]])
    general_out, runs = executed_conditionals(monkeypatch, logits5, general)
    assert runs > 2
    np.testing.assert_array_equal(general_out.token_ids[:4], out.token_ids)
    cpu = jax.device_get(traced_afresh()(logits, arrays_for(qwen3, logits)).token_ids)
    np.testing.assert_array_equal(cpu, out.token_ids)
