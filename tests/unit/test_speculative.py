"""Speculative decoding's pieces that need no engine: the config as users pass it, the
n-gram proposer, and lossless verification (serving/sample/rejection.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from serving.core.draft_length import EMA, DraftLengths, SpeculationSwitch
from serving.core.speculative import SpeculativeConfig, propose_ngram
from serving.sample.rejection import rejection_sample


def test_config_from_vllm_json_and_dict():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                     '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 4)
    same = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert same == config and SpeculativeConfig.parse(config) is config
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_min": 3}).prompt_lookup_max == 3


@pytest.mark.parametrize("value, match", [
    ("{not json", r"speculative_config must be a JSON object, got '\{not json'"),
    ("[1]", "speculative_config must be a JSON object, got \\[1\\]"),
    ({"method": "medusa", "num_speculative_tokens": 2},
     "speculative_config.method must be one of ngram, draft_model, eagle3, got 'medusa'"),
    ({"num_speculative_tokens": 2}, "speculative_config.method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     r"speculative_config.num_speculative_tokens must be an int in \[1, 16\], got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_max must be an int >= prompt_lookup_min=3, got 2"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3},
     "speculative_config.model must be a model directory or name, got 3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_draft_length": "no"},
     "speculative_config.adaptive_draft_length must be true or false, got 'no'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
     r"speculative_config's keys must be among .*, got \['lookahead'\]"),
])
def test_bad_configs_name_the_field_value_and_limit(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)


def test_ngram_drafts_what_followed_the_latest_match_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # suffix 3-gram [5, 6, 7] occurred at 0: draft what followed (8, 1, 6)
    assert propose_ngram(tokens, k=3, min_n=1, max_n=3) == [8, 1, 6]
    # at n = 2, [6, 7] occurred last at 5: (9, 5)
    assert propose_ngram(tokens, k=2, min_n=1, max_n=2) == [9, 5]
    # no earlier occurrence of the suffix at any n: no draft
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []
    # fewer than k tokens after the match: as many as there are
    assert propose_ngram([3, 4, 3], k=4, min_n=1, max_n=2) == [4, 3]
    assert propose_ngram([7], k=2, min_n=1, max_n=2) == []


def _ngram_by_loops(tokens, k, min_n, max_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_matches_a_plain_search_on_random_token_streams():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 40)).tolist()
        min_n = int(rng.integers(1, 3))
        max_n = min_n + int(rng.integers(0, 3))
        assert propose_ngram(tokens, k=3, min_n=min_n, max_n=max_n) == _ngram_by_loops(
            tokens, 3, min_n, max_n), (tokens, min_n, max_n)


def _draws(rng, rows, k, vocab):
    uniforms = rng.uniform(size=(rows, k)).astype(np.float32)
    noise = -np.log(-np.log(rng.uniform(1e-9, 1, size=(rows, k + 1, vocab))))
    return jnp.asarray(uniforms), jnp.asarray(noise.astype(np.float32))


def _distribution(rng, vocab):
    p = rng.dirichlet(np.ones(vocab)).astype(np.float32)
    return p


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_emitted_tokens_follow_the_targets_distribution(draft):
    # Fixed target distributions p1 (first position) and p2 (after the first draft), a
    # draft distribution q1 or an n-gram draft; over many rows the first emitted token is
    # distributed as p1, and the second (emitted only after the first draft was kept) as
    # p2. Plain acceptance of every draft fails the first check.
    rng = np.random.default_rng(3)
    rows, vocab, k = 200_000, 6, 2
    p1, p2, p3 = (_distribution(rng, vocab) for _ in range(3))
    q1, q2 = _distribution(rng, vocab), _distribution(rng, vocab)
    target = jnp.asarray(np.broadcast_to(np.stack([p1, p2, p3]), (rows, 3, vocab)))
    if draft == "model":  # drafts drawn from q
        d1 = rng.choice(vocab, size=rows, p=q1 / q1.sum())
        d2 = rng.choice(vocab, size=rows, p=q2 / q2.sum())
        draft_probs = jnp.asarray(np.broadcast_to(np.stack([q1, q2]), (rows, 2, vocab)))
    else:  # the same two n-gram drafts in every row
        d1, d2 = np.full(rows, 2), np.full(rows, 4)
        draft_probs = None
    drafts = jnp.asarray(np.stack([d1, d2], axis=1).astype(np.int32))
    uniforms, noise = _draws(rng, rows, k, vocab)
    count, tokens = rejection_sample(target, drafts, jnp.full((rows,), k, jnp.int32),
                                     uniforms, noise, draft_probs)
    count, tokens = np.asarray(count), np.asarray(tokens)
    first = np.bincount(tokens[:, 0], minlength=vocab) / rows
    np.testing.assert_allclose(first, p1, atol=4e-3)
    # the second token, where the first was the first draft (p2 is the target's there)
    kept = count >= 1
    second = np.bincount(tokens[kept, 1], minlength=vocab) / kept.sum()
    np.testing.assert_allclose(second, p2, atol=8e-3)
    # emitted tokens: count + 1 per row, drafts where accepted
    assert np.all(tokens[kept, 0] == np.asarray(d1)[kept])
    index = np.arange(k + 1)[None, :]
    assert np.all(tokens[index > count[:, None]] == 0)
    # what plain acceptance would give: the first token always the draft
    plain = np.bincount(np.asarray(d1), minlength=vocab) / rows
    assert np.abs(plain - p1).max() > 0.05


def test_rows_without_drafts_decode_from_the_first_position():
    rng = np.random.default_rng(5)
    rows, vocab = 100_000, 5
    p = _distribution(rng, vocab)
    target = jnp.asarray(np.broadcast_to(np.stack([p, p, p]), (rows, 3, vocab)))
    uniforms, noise = _draws(rng, rows, 2, vocab)
    count, tokens = rejection_sample(target, jnp.zeros((rows, 2), jnp.int32),
                                     jnp.zeros((rows,), jnp.int32), uniforms, noise)
    assert not np.any(np.asarray(count))
    np.testing.assert_allclose(np.bincount(np.asarray(tokens)[:, 0], minlength=vocab) / rows,
                               p, atol=5e-3)


def test_scheduler_runs_drafts_as_query_tokens_and_rolls_rejected_ones_back():
    from serving.core.config import SchedulerConfig
    from serving.core.kv_cache_manager import KVCacheManager
    from serving.core.request import Request, SamplingParams
    from serving.core.scheduler import Scheduler

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                             watermark=0.0, kv_plan_limit=1.0)
    s = Scheduler(config, KVCacheManager(64, 4, enable_prefix_caching=True))
    requests = [Request(f"r{i}", list(range(10 * i, 10 * i + 6)),
                        SamplingParams(max_tokens=20)) for i in range(3)]
    for request in requests:
        s.add_request(request)
    out = s.schedule()  # the prompts
    for request in requests:
        request.append_output_token(99)
    s.update_after_step(out)
    requests[0].draft_token_ids = [1, 2, 3]
    requests[1].draft_token_ids = [4, 5]
    out = s.schedule()
    # 3 sequences + 5 drafts > 4 rows (the largest sequence bucket, max_num_seqs here):
    # drafts dropped from the last back
    assert [(q.num_new_tokens, q.num_drafts, q.samples) for q in out.scheduled] == [
        (2, 1, True), (1, 0, True), (1, 0, True)]
    assert out.num_drafts == 1 and out.num_rows == 4
    assert requests[0].tokens(6, 8) == [99, 1]  # its token, then its draft
    requests[0].append_output_token(1)  # the draft was kept, and the token after it
    requests[0].append_output_token(50)
    for request in requests[1:]:
        request.append_output_token(98)
    s.update_after_step(out, {"r0": 0})
    assert [r.num_computed_tokens for r in requests] == [8, 7, 7]
    # a rejected draft's position is computed again next step (the engine proposes
    # before every schedule: no drafts for the others)
    requests[0].draft_token_ids = requests[1].draft_token_ids = []
    requests[2].draft_token_ids = [7, 8]  # 3 rows + 2 drafts: one fits
    out = s.schedule()
    seq = out.scheduled[2]
    assert (seq.request is requests[2], seq.num_new_tokens, seq.num_drafts) == (True, 2, 1)
    s.update_after_step(out, {"r2": 1})
    assert requests[2].num_computed_tokens == 8  # its token only: the draft's KV dropped


# ---- draft lengths (serving/core/draft_length.py) --------------------------------------
def _timed(costs: dict[int, float]) -> DraftLengths:
    lengths = DraftLengths(tuple(costs))
    for bucket, seconds in costs.items():
        lengths.observe_step(bucket, 100.0)  # a bucket's first step (a compile) is not used
        lengths.observe_step(bucket, seconds)
    return lengths


def _accepting(lengths: DraftLengths, request_id: str, rate: float, steps: int = 40) -> None:
    kept = round(rate * 10)
    for _ in range(steps // 10):  # verified 10 at a time: kept of them, each step of one
        for _ in range(kept):
            lengths.observe_verify(request_id, 1, 1)
        for _ in range(10 - kept):
            lengths.observe_verify(request_id, 1, 0)


def test_every_draft_is_verified_while_the_step_costs_the_same():
    lengths = _timed({8: 1.0, 16: 1.0, 32: 1.0})
    assert lengths.choose([("a", 3), ("b", 2), ("c", 0)], 3) == [3, 2, 0]
    assert DraftLengths((8, 16)).choose([("a", 3)], 1) == [3]  # nothing timed yet


def test_drafts_stop_where_the_next_bucket_costs_more_than_they_give():
    lengths = _timed({8: 1.0, 16: 1.9, 32: 4.0})
    for request_id in "abcdefgh":
        _accepting(lengths, request_id, 0.5)
    # 8 decoding sequences: a 16-token step would have to give 1.9x the tokens
    counts = lengths.choose([(r, 3) for r in "abcdefgh"], 8)
    assert sum(counts) == 0
    lengths.seconds[16] = 1.2  # now the next 8 drafts (0.5 each) pay for it
    assert sum(lengths.choose([(r, 3) for r in "abcdefgh"], 8)) == 8


def test_the_likeliest_kept_drafts_go_first_and_failing_sequences_get_none():
    lengths = _timed({4: 1.0, 8: 1.5})
    _accepting(lengths, "good", 0.9)
    _accepting(lengths, "bad", 0.0)
    assert lengths.acceptance("good") > 0.7 and lengths.acceptance("bad") < 0.2
    counts = lengths.choose([("good", 5), ("bad", 5)], 2)
    assert counts[1] == 0 and counts[0] >= 2  # 2 + its drafts fit the 4 bucket at least
    lengths.forget("bad")  # a new sequence starts from the engine's rate
    assert lengths.acceptance("bad") == pytest.approx((lengths.kept + 1) / (lengths.tested + 2))


def test_a_bucket_not_timed_costs_as_the_largest_timed_below_it():
    lengths = _timed({8: 2.0, 64: 9.0})
    lengths.buckets = (8, 16, 32, 64)
    assert lengths.cost(12) == 2.0 and lengths.cost(20) == 2.0 and lengths.cost(33) == 9.0
    assert lengths.cost(3) == 2.0 and lengths.cost(1000) == 9.0


def _run_switch(switch: SpeculationSwitch, steps: int, rates: dict[bool, float],
                num_running: int = 1) -> list[bool]:
    modes = []
    for _ in range(steps):
        mode = switch.choose(num_running)
        modes.append(mode)
        switch.observe(int(rates[mode]), 1.0)  # tokens in one second
    return modes


def test_the_switch_measures_both_modes_then_runs_the_faster_and_probes_the_other():
    switch = SpeculationSwitch()
    probe, every = SpeculationSwitch.PROBE_STEPS, SpeculationSwitch.EXPLORE_EVERY
    modes = _run_switch(switch, 2 * (probe + 1) + 3 * (every + probe), {True: 30, False: 10})
    # speculation measured first (probe steps), then the plain loop (one more: the switch's
    # first step is not counted), then speculation, faster, with a probe of the other
    assert modes[:probe] == [True] * probe
    assert modes[probe:2 * probe + 1] == [False] * (probe + 1)
    settled = modes[2 * probe + 1:]
    assert settled.count(True) > 0.8 * len(settled) and settled.count(False) >= 2 * probe
    # where the plain loop is faster, it runs (a second load class, its own measurements)
    modes = _run_switch(switch, 2 * (probe + 1) + every, {True: 10, False: 30}, num_running=8)
    settled = modes[2 * probe + 1:]
    assert settled[:every - 1] == [False] * (every - 1)


def _probe_starts(modes: list[bool], faster: bool) -> list[int]:
    return [i for i in range(1, len(modes)) if modes[i] != faster and modes[i - 1] == faster]


def test_probes_that_confirm_the_choice_come_ever_less_often_up_to_a_bound():
    probe, every = SpeculationSwitch.PROBE_STEPS, SpeculationSwitch.EXPLORE_EVERY
    most = SpeculationSwitch.MAX_EXPLORE_EVERY
    switch = SpeculationSwitch()
    modes = _run_switch(switch, 2 * (probe + 1) + 6000, {True: 10, False: 30})
    settled = modes[2 * probe + 1:]
    starts = _probe_starts(settled, False)
    assert all(settled[s:s + probe] == [True] * probe and not settled[s + probe]
               for s in starts)  # each probe: PROBE_STEPS steps of the slower mode
    gaps = [b - a - probe for a, b in zip(starts, starts[1:])]
    # the faster mode's steps between probes: 64 first, then twice as many each time, to
    # the bound
    assert starts[0] == every
    assert gaps[:4] == [2 * every, 4 * every, 8 * every, most] and set(gaps[4:]) == {most}


def test_a_probe_that_changes_the_choice_starts_the_probes_count_again():
    probe, every = SpeculationSwitch.PROBE_STEPS, SpeculationSwitch.EXPLORE_EVERY
    switch = SpeculationSwitch()
    rates = {True: 10, False: 30}
    _run_switch(switch, 2 * (probe + 1) + 3000, rates)  # probes now far apart
    rates[True], rates[False] = 90, 30  # the load changed: speculation now pays
    modes = _run_switch(switch, 2200, rates)
    first = modes.index(True)
    assert modes[first:first + probe] == [True] * probe
    # the probe's rates turn the choice: speculation runs, the plain loop is probed
    # after EXPLORE_EVERY steps again, not after the interval the old choice reached
    after = modes[first + probe:]
    assert after[:every] == [True] * every and after[every:every + probe] == [False] * probe


def test_the_switch_does_not_count_steps_with_a_prompt_chunk():
    switch = SpeculationSwitch()
    for _ in range(3):
        switch.choose(1)
        switch.observe(8, 0.001, decode_only=False)  # a batch's first tokens, from a prefill
    assert switch._rates.samples[True] == 0 and switch._rates.rate == {}
    switch.choose(1)
    switch.observe(2, 1.0)
    assert switch._rates.samples[True] == 1 and switch._rates.rate[True] == 2.0


def test_the_switch_rates_a_mode_by_its_tokens_over_its_seconds():
    switch = SpeculationSwitch()
    for tokens, seconds in [(10, 1.0), (1, 0.01)]:  # 10/s then 100/s: 11 tokens in 1.01 s
        switch.choose(1)
        switch.observe(tokens, seconds)
    rate = switch._rates.rate[True]
    kept = 1 - EMA
    assert rate == (kept * 10 + 1) / (kept * 1.0 + 0.01)
    assert rate < 15  # an average of the two steps' own rates: 10 + EMA * (100 - 10) = 28


def test_the_switch_does_not_count_the_step_that_changes_mode():
    switch = SpeculationSwitch()
    for _ in range(SpeculationSwitch.PROBE_STEPS):
        switch.choose(1)
        switch.observe(10, 1.0)
    assert switch.choose(1) is False  # the switch: the plain loop's first step
    switch.observe(1000, 1.0)  # finishing the speculating step in flight: not counted
    assert switch._rates.samples[False] == 0
