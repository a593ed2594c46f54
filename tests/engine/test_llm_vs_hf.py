"""Greedy LLM.generate (float32) equals HF transformers generate token for token, whatever
the batching: alone, all at once, chunked prefill, preemption, prefix caching."""

import pytest

from qwen_jax import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, make_prompts

MAX_TOKENS = 12
LENGTHS = [1, 5, 23, 70, 9, 40]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(LENGTHS)


@pytest.fixture(scope="module")
def expected(tiny_ckpt, prompts):
    return [hf_greedy(tiny_ckpt[1], p, MAX_TOKENS) for p in prompts]


def make_llm(tiny_ckpt, compile_cache, **kwargs):
    args = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128,
                compilation_cache_dir=compile_cache, token_buckets=[8, 32, 128],
                seq_buckets=[4, 8], show_progress=False)
    args.update(kwargs)
    return LLM(str(tiny_ckpt[0]), **args)


def generate_ids(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm):
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_pages"] == stats["num_total_pages"]


def test_all_at_once_matches_hf(tiny_ckpt, compile_cache, prompts, expected):
    llm = make_llm(tiny_ckpt, compile_cache)
    assert generate_ids(llm, prompts) == expected
    assert_no_leak(llm)


def test_one_at_a_time_matches_hf(tiny_ckpt, compile_cache, prompts, expected):
    llm = make_llm(tiny_ckpt, compile_cache)
    assert [generate_ids(llm, [p])[0] for p in prompts] == expected
    assert_no_leak(llm)


def test_tiny_token_budget_chunks_prefill_and_matches_hf(tiny_ckpt, compile_cache, prompts,
                                                          expected):
    llm = make_llm(tiny_ckpt, compile_cache, max_num_seqs=4, max_num_batched_tokens=8,
                   token_buckets=[8], seq_buckets=[4])
    assert generate_ids(llm, prompts) == expected
    assert_no_leak(llm)


def test_tiny_kv_pool_preempts_and_matches_hf(tiny_ckpt, compile_cache):
    # All five prompts are admitted (7 pages) but each crosses a page boundary while
    # decoding (12 pages in all): 8 usable pages force preemption by recompute.
    prompts = make_prompts([15, 14, 31, 30, 13], seed=3)
    expected = [hf_greedy(tiny_ckpt[1], p, MAX_TOKENS) for p in prompts]
    llm = make_llm(tiny_ckpt, compile_cache, num_gpu_blocks_override=9)
    assert generate_ids(llm, prompts) == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_no_leak(llm)


def test_prefix_cache_hits_leave_output_unchanged(tiny_ckpt, compile_cache):
    shared = make_prompts([48], seed=7)[0]
    prompts = [shared + tail for tail in make_prompts([3, 17, 1, 30], seed=8)]
    expected = [hf_greedy(tiny_ckpt[1], p, MAX_TOKENS) for p in prompts]
    llm = make_llm(tiny_ckpt, compile_cache, enable_prefix_caching=True)
    assert generate_ids(llm, prompts) == expected
    first_hits = llm.stats()["prefix_cache_hits"]
    assert generate_ids(llm, prompts) == expected
    stats = llm.stats()
    assert stats["prefix_cache_hits"] - first_hits >= 4 * 48  # every prompt reuses the prefix
    assert stats["prefix_cache_hit_rate"] > 0
    assert_no_leak(llm)


def test_prefix_caching_off_never_hits(tiny_ckpt, compile_cache, prompts, expected):
    llm = make_llm(tiny_ckpt, compile_cache, enable_prefix_caching=False)
    assert generate_ids(llm, prompts) == expected
    assert generate_ids(llm, prompts) == expected
    assert llm.stats()["prefix_cache_hits"] == 0
