"""Speculative decoding in the engine (serving/engine/speculation.py), n-gram, draft
model and EAGLE-3: greedy texts identical to the engine without it, in every scheduling mode,
with drafts really kept, and no page left behind."""

from __future__ import annotations

import pytest

from qwen_jax import LLM, SamplingParams, tasks
from serving.bench.eval_tasks import TINY_MODEL, chat_template, generate_texts, render_prompts

# every proposed draft verified, every step speculating (the adaptive choice has its test)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive_draft_length": False}
EVERY_TASK = (tasks.TASKS, 2)
# the tiny model as its own draft: every draft is the target's greedy token but where a
# draft's position is in a page not allocated yet (its K/V in the scratch page)
SELF_DRAFT = {"method": "draft_model", "model": str(TINY_MODEL), "num_speculative_tokens": 3,
              "adaptive_draft_length": False}
# the embedded model's shipped EAGLE-3 head (scripts/train_eagle3.py)
EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 3, "adaptive_draft_length": False}
PROPOSERS = {"ngram": NGRAM, "self_draft": SELF_DRAFT, "eagle3": EAGLE3}
# mean acceptance length at least: the target as its own draft, the shipped head
ACCEPTANCE_FLOOR = {"self_draft": 3.0, "eagle3": 2.0}
# 16 list prompts of 2 pages each in 20 pages of 16 tokens: they run out of pages while
# decoding into their third (as in tests/e2e/test_tiny_model.py)
LISTS = (("reverse", "sort"), 8)
# (engine options, prompts): the tiny model's tasks copy, reverse and sort their
# prompts' tokens, so n-gram drafts are often right.
CONFIGS = {
    "all_at_once": (dict(enable_prefix_caching=False), EVERY_TASK),
    "chunked_prefill": (dict(enable_prefix_caching=False, max_num_seqs=8,
                             max_num_batched_tokens=32), EVERY_TASK),
    "prefix_caching": (dict(enable_prefix_caching=True), EVERY_TASK),
    "tiny_pool_preempts": (dict(enable_prefix_caching=False, num_gpu_blocks_override=20),
                           LISTS),
    "tiny_pool_swaps": (dict(enable_prefix_caching=False, num_gpu_blocks_override=20,
                             swap_space=0.01, swap_min_tokens=1), LISTS),
}


def _prompts(task_names, per_task):
    problems = [p for t in task_names for p in tasks.problems(t, per_task, seed=5)]
    return render_prompts(problems, chat_template(TINY_MODEL))


# Few buckets, the same in every engine here (a plain engine's steps are an n-gram or draft
# model engine's target steps): each (tokens, rows) shape a test meets compiles once, some
# seconds on a CPU. 16 sequences verify 3 drafts each in 64 rows.
BUCKETS = dict(max_num_seqs=16, token_buckets=(16, 64, 512), seq_buckets=(8, 64))


def _llm(**kwargs):
    return LLM(model=str(TINY_MODEL), precompile=False, show_progress=False,
               **{**BUCKETS, **kwargs})


@pytest.fixture(scope="module")
def plain_llm():
    """The engine without speculation (tests/e2e/test_tiny_model.py holds it to the full
    forward pass)."""
    return _llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def spec_llm():
    return _llm(enable_prefix_caching=False, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def plain_texts(plain_llm):
    return {prompts: generate_texts(plain_llm, _prompts(*prompts))
            for prompts in (EVERY_TASK, LISTS)}


def _spec_counts(llm) -> tuple[int, int]:
    stats = llm.stats()
    return stats["spec_decode_num_drafts"], stats["spec_decode_num_accepted_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_texts_equal_the_engine_without_speculation(name, proposer, plain_texts, request):
    options, prompts = CONFIGS[name]
    llm = (request.getfixturevalue("spec_llm") if (name, proposer) == ("all_at_once", "ngram")
           else _llm(**options, speculative_config=PROPOSERS[proposer]))
    passes = 2 if options["enable_prefix_caching"] else 1  # the second hits the cache
    for _ in range(passes):
        assert generate_texts(llm, _prompts(*prompts)) == plain_texts[prompts]
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, "no draft was ever kept"
    if proposer == "ngram":
        assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        assert stats["spec_decode_mean_acceptance_length"] > 1
    else:  # the draft's cache follows every preemption, swap and prefix hit
        assert stats["spec_decode_mean_acceptance_length"] > ACCEPTANCE_FLOOR[proposer]
    if name.startswith("tiny_pool"):
        assert stats["num_preemptions"] > 0
    if name == "tiny_pool_swaps":
        assert stats["num_swap_outs"] > 0
    if name == "prefix_caching":
        assert stats["prefix_cache_hits"] > 0
    else:  # every page back in the pool
        assert stats["num_used_pages"] == 0


def test_model_drafts_stay_on_the_device_unless_a_row_needs_them_on_the_host(
        plain_llm, plain_texts):
    # The head's drafts feed the verify step on the device (the host reads them with the
    # step's tokens); a penalised request's rows need them on the host first, and get
    # them there. Both give the plain engine's tokens, as does the host-drafts engine.
    llm = _llm(enable_prefix_caching=False, speculative_config=EAGLE3)
    speculator = llm.llm_engine.speculator
    prompts = _prompts(*EVERY_TASK)
    assert generate_texts(llm, prompts) == plain_texts[EVERY_TASK]
    on_device = speculator.num_device_proposals
    assert on_device > 0 and speculator.num_accepted_tokens > 0
    penalised = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)
    verified = speculator.num_drafts
    got = llm.generate(prompts[:1], penalised)[0].outputs[0].token_ids
    assert got == plain_llm.generate(prompts[:1], penalised)[0].outputs[0].token_ids
    assert speculator.num_drafts > verified  # it speculated, its drafts read first
    assert speculator.num_device_proposals == on_device
    speculator.keep_drafts_on_device = False
    assert generate_texts(llm, prompts) == plain_texts[EVERY_TASK]
    assert speculator.num_device_proposals == on_device
    assert llm.stats()["num_used_pages"] == 0


def test_sampled_penalised_min_tokens_and_logprob_requests_equal_the_plain_engine(
        plain_llm, spec_llm):
    # One batch, every request drafted: greedy, greedy with logprobs, a penalty, seeded
    # samples (n = 2, top-p/top-k), min_tokens; each gives the plain engine's tokens (a
    # row draws as the plain engine's draw for its output index), logprobs to rounding.
    prompts = _prompts(("copy",), 1) * 5
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3,
                             presence_penalty=0.5),
              SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7, n=2,
                             max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=20)]
    plain = plain_llm.generate(prompts, params)
    drafts, accepted = _spec_counts(spec_llm)
    spec = spec_llm.generate(prompts, params)
    assert ([[c.token_ids for c in o.outputs] for o in spec]
            == [[c.token_ids for c in o.outputs] for o in plain])
    assert len(spec[4].outputs[0].token_ids) >= 20
    for got, want in zip(spec[1].outputs[0].logprobs, plain[1].outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token, entry in got.items():
            assert entry.rank == want[token].rank
            assert entry.logprob == pytest.approx(want[token].logprob, rel=1e-4, abs=1e-5)
    new_drafts, new_accepted = (b - a for a, b in zip((drafts, accepted),
                                                       _spec_counts(spec_llm)))
    # more verify steps than one request's 23 tokens after its first allow
    assert new_drafts > 23 and new_accepted > 0


def test_seeded_samples_keep_only_the_drafts_the_target_draws(plain_llm, spec_llm):
    # At temperature 1 the target often draws something else than the n-gram draft: a
    # verifier that kept drafts regardless (or drew its rows with other noise) would give
    # other texts than the plain engine's for these seeds.
    prompts = _prompts(("reverse", "copy"), 2)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=32) for seed in range(4)]
    plain = plain_llm.generate(prompts, params)
    drafts, accepted = _spec_counts(spec_llm)
    spec = spec_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    new_drafts, new_accepted = (b - a for a, b in zip((drafts, accepted),
                                                       _spec_counts(spec_llm)))
    assert new_drafts > 0 and new_accepted > 0


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_the_adaptive_engine_speculates_and_overlaps_by_turns_with_the_same_tokens(
        plain_llm, proposer):
    # adaptive_draft_length (the default): drafts per sequence by acceptance and step cost,
    # and steps with or without speculation by measured tokens/s; it tries both at first,
    # so both kinds of step run here, switching while sequences decode (the draft model's
    # cache catches up on the tokens of the steps without it).
    llm = _llm(enable_prefix_caching=False,
               speculative_config={**PROPOSERS[proposer], "adaptive_draft_length": True})
    prompts = _prompts(tasks.TASKS, 2)
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=48, ignore_eos=True)]
    for sampling in params:
        plain = plain_llm.generate(prompts, sampling)
        assert ([o.outputs[0].token_ids for o in llm.generate(prompts, sampling)]
                == [o.outputs[0].token_ids for o in plain])
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert llm.llm_engine.num_overlapped_steps > 0
    steps = llm.llm_engine.speculator.num_steps  # engine steps begun in either mode
    assert steps[True] >= stats["spec_decode_num_drafts"] // 8 > 0 and steps[False] > 0
    assert stats["num_used_pages"] == 0


# the flags the switch is given, step by step: request a's prompt at step 0, b's at step 6;
# an overlapped step counts the step it reads back and the one it dispatches
PROMPT_CHUNK_FLAGS = {True: [False, True, True, True, True, True, False, True],
                      False: [False, False, True, True, True, True, False, False, True]}


@pytest.mark.parametrize("speculating", [True, False], ids=["serial", "overlapped"])
def test_the_switch_is_told_which_steps_took_a_prompt_chunk(speculating):
    llm = _llm(enable_prefix_caching=False,
               speculative_config={**NGRAM, "adaptive_draft_length": True})
    engine = llm.llm_engine
    switch = engine.speculator.switch
    switch.choose = lambda num_running: speculating
    seen = []
    switch.observe = lambda num_tokens, seconds, decode_only=True: seen.append(decode_only)
    a, b = _prompts(("reverse",), 2)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engine.add_request("a", a, params)
    for _ in range(6):
        engine.step()
    engine.add_request("b", b, params)
    while engine.has_unfinished_requests():
        engine.step()
    expected = PROMPT_CHUNK_FLAGS[speculating]
    assert seen[:len(expected)] == expected
    assert all(seen[len(expected):])
    assert engine.num_overlapped_steps > 0 or speculating


def test_seeded_samples_with_a_draft_model_equal_the_plain_engine(plain_llm):
    # the draft proposes greedily: one token each, kept while the target's draw equals it
    llm = _llm(enable_prefix_caching=False, speculative_config=SELF_DRAFT)
    prompts = _prompts(("reverse", "add"), 2)
    params = [SamplingParams(temperature=0.7, top_k=10, seed=seed, max_tokens=40,
                             ignore_eos=True) for seed in range(4)]
    plain = plain_llm.generate(prompts, params)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain])
    stats = llm.stats()
    assert 1.5 < stats["spec_decode_mean_acceptance_length"] < 4  # the draws differ at times


@pytest.mark.slow
def test_the_draft_model_compiles_at_start_up_only():
    # few buckets: a cold start compiles every one, the target's and the proposer's
    llm = LLM(model=str(TINY_MODEL), show_progress=False, max_num_seqs=8,
              max_num_batched_tokens=64, token_buckets=[8, 64], seq_buckets=[2, 8],
              enable_prefix_caching=False,
              speculative_config=SELF_DRAFT)
    compiled = llm.stats()["num_compiles"]
    assert compiled == 2 * len(llm.llm_engine.bucket_pairs)  # the target's and the draft's
    llm.generate(_prompts(tasks.TASKS, 2), SamplingParams(temperature=0, max_tokens=24))
    assert llm.stats()["num_compiles"] == compiled
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("proposer", ["ngram", "eagle3"])
def test_requests_under_a_grammar_draft_within_it(plain_llm, proposer):
    # drafts stop before the first the grammar forbids, and draft row j samples under
    # the grammar's state after drafts 0..j (its masks: tests/unit/test_structured.py):
    # the same texts as without speculation, every token within its grammar
    llm = _llm(enable_prefix_caching=False, speculative_config=PROPOSERS[proposer])
    prompts = _prompts(("copy", "reverse"), 2)
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs={
                  "regex": "[a-z ]{10,30}"}),
              SamplingParams(temperature=0, max_tokens=48,
                             structured_outputs={"choice": ["alpha beta gamma", "alpha beta"]}),
              SamplingParams(temperature=0, max_tokens=24)]
    params = [params[i % 3] for i in range(len(prompts))]
    plain, spec = (llm_.generate(prompts, params) for llm_ in (plain_llm, llm))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert all(o.outputs[0].finish_reason != "error" for o in spec)
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["num_used_pages"] == 0


@pytest.mark.slow
def test_max_num_seqs_sequences_verify_all_their_drafts(plain_llm):
    # the sequence buckets grow to max_num_seqs * (1 + k) rows with speculation: four
    # sequences at once, three drafts each, none cut for want of rows
    llm = _llm(enable_prefix_caching=False, max_num_seqs=4, seq_buckets=None,
               speculative_config=SELF_DRAFT)
    assert max(llm.llm_engine.scheduler_config.seq_bucket_sizes) == 16
    prompts = _prompts(("copy",), 4)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    plain, spec = (llm_.generate(prompts, params) for llm_ in (plain_llm, llm))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.stats()
    # 24 tokens after the first: each sequence verifies about six times, three drafts
    # each but where max_tokens leaves less room (4 rows of max_num_seqs: none at all)
    assert stats["spec_decode_num_drafts"] >= 4 * 5
    assert stats["spec_decode_num_draft_tokens"] > 2.8 * stats["spec_decode_num_drafts"]


def test_max_tokens_bounds_the_drafts(plain_llm, spec_llm):
    prompts = _prompts(("copy",), 2)
    for max_tokens in (1, 2, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        plain, spec = (llm.generate(prompts, params) for llm in (plain_llm, spec_llm))
        for a, b in zip(spec, plain):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert len(a.outputs[0].token_ids) == max_tokens


@pytest.mark.parametrize("config, match", [
    ({"method": "medusa", "num_speculative_tokens": 3},
     "speculative_config.method must be one of ngram, draft_model, eagle3, got 'medusa'"),
    ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
])
def test_unsupported_configs_are_refused_at_start(config, match):
    from serving.engine.config import EngineConfig
    with pytest.raises((ValueError, TypeError), match=match):
        EngineConfig(speculative_config=config)


@pytest.mark.slow
def test_the_embedded_model_drafts_with_its_shipped_draft_model(plain_llm, plain_texts):
    # {"method": "draft_model"} without a model: qwen_jax/assets/tiny-qwen3-draft, two
    # dense layers trained on the same tasks (scripts/train_tiny.py --draft)
    llm = _llm(enable_prefix_caching=False, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "adaptive_draft_length": False})
    draft = llm.llm_engine.speculator.draft.runner.config
    assert (draft.num_hidden_layers, draft.hidden_size) == (2, 64)
    assert generate_texts(llm, _prompts(*EVERY_TASK)) == plain_texts[EVERY_TASK]
    assert llm.stats()["spec_decode_mean_acceptance_length"] > 2.5


@pytest.mark.parametrize("method, what", [("draft_model", "the draft model"),
                                          ("eagle3", "the EAGLE-3 head")])
def test_a_draft_model_is_needed_for_another_target(tmp_path, method, what):
    from tests.helpers.hf import save_hf_model
    save_hf_model(tmp_path, moe=False, vocab_size=96, seed=1)
    with pytest.raises(ValueError, match=f"speculative_config.model must be {what}'s "
                                         "directory"):
        LLM(model=str(tmp_path), precompile=False, show_progress=False,
            speculative_config={"method": method, "num_speculative_tokens": 2})


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(tmp_path):
    from tests.helpers.hf import save_hf_model
    save_hf_model(tmp_path, moe=False, vocab_size=96, seed=1)
    with pytest.raises(ValueError, match=r"speculative_config.model must be a model with the "
                                         r"target's vocabulary of 896 tokens \(it has 96\)"):
        _llm(speculative_config={"method": "draft_model", "model": str(tmp_path),
                                 "num_speculative_tokens": 2})


def test_metrics_use_vllms_spec_decode_names():
    from serving.metrics.prometheus import Metrics
    from tests.helpers.prometheus import parse_values

    values = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
              "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
              "num_compiles": 0, "num_used_pages": 0, "num_total_pages": 9,
              "max_num_batched_tokens": 64, "degraded": 0, "num_degradation_switches": 0,
              "num_priority_boosts": 0, "num_swapped_requests": 0, "swap_space_usage": 0.0,
              "num_swap_outs": 0, "num_swap_ins": 0, "num_recomputed_tokens": 0,
              "spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 15,
              "spec_decode_num_accepted_tokens": 7,
              "spec_decode_num_accepted_tokens_per_pos": [4, 2, 1]}

    class Engine:
        dead = None

        @staticmethod
        def stats():
            return values

    label = '{model_name="m"}'
    for prefix in ("vllm", "qwen_jax"):
        scraped = parse_values(Metrics(Engine(), "m", prefix=prefix).render().decode())
        assert scraped[f"{prefix}:spec_decode_num_drafts_total{label}"] == 5
        assert scraped[f"{prefix}:spec_decode_num_draft_tokens_total{label}"] == 15
        assert scraped[f"{prefix}:spec_decode_num_accepted_tokens_total{label}"] == 7
        assert [scraped[f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total'
                        f'{{model_name="m",position="{i}"}}'] for i in range(3)] == [4, 2, 1]


def test_verify_keeps_drafts_while_they_match_and_reports_the_rest_rejected():
    from serving.core.request import Request
    from serving.core.scheduler_output import ScheduledSeq, SchedulerOutput
    from serving.core.speculative import SpeculativeConfig
    from serving.engine.speculation import Speculator

    def seq(name, drafts):
        request = Request(name, [1, 2, 3])
        request.draft_token_ids = list(drafts)
        return ScheduledSeq(request, 1 + len(drafts), 2, True, num_drafts=len(drafts))

    # rows 0..2: the sequences' own rows; then a's 3 draft rows, then c's 2
    out = SchedulerOutput([seq("a", [7, 8, 9]), seq("b", []), seq("c", [4, 5])], [],
                          num_drafts=5)
    tokens = [30, 31, 32, 7, 8, 6, 9, 5]
    speculator = Speculator(SpeculativeConfig.parse(NGRAM), (8, 16))
    emitted = speculator.verify(out, tokens)
    # a: 7 and 8 kept, 9 rejected (the target says 6); c: 4 rejected at once (target 9);
    # each token with the row it was sampled in (its logprobs' row)
    assert emitted == {0: [(7, 3), (8, 4), (6, 5)], 2: [(9, 6)]}
    assert speculator.rejected == {"a": 1, "c": 2}
    assert (speculator.num_drafts, speculator.num_draft_tokens) == (2, 5)
    assert speculator.num_accepted_tokens == 2 and speculator.accepted_per_position == [1, 1, 0]
    # all drafts kept: the sequence's own row gives the token after them
    out = SchedulerOutput([seq("d", [7, 8])], [], num_drafts=2)
    assert speculator.verify(out, [40, 7, 8]) == {0: [(7, 1), (8, 2), (40, 0)]}
    assert speculator.rejected == {"d": 0}
    assert speculator.mean_acceptance_length == 1 + 4 / 3


async def test_streamed_deltas_through_async_llm_reassemble_the_plain_text(plain_llm):
    from qwen_jax import AsyncLLM
    from serving.core.request import RequestOutputKind

    prompts = _prompts(("copy", "reverse"), 1)
    plain = generate_texts(plain_llm, prompts)
    llm = AsyncLLM(str(TINY_MODEL), precompile=False, enable_prefix_caching=False,
                   speculative_config=NGRAM, **BUCKETS)
    try:
        params = SamplingParams(temperature=0, max_tokens=64,
                                output_kind=RequestOutputKind.DELTA)
        for prompt, expected in zip(prompts, plain):
            deltas = [out.outputs[0].text async for out in llm.generate(prompt, params)]
            assert "".join(deltas) == expected
        stats = llm.stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.shutdown()
