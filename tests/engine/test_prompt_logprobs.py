"""Prompt logprobs in the continuous batch (serving/engine/prompt_scoring.py): the rows of
each prefill chunk scored in the steps that compute them, equal to HF's log-softmax of a
full forward, for prompts longer than a chunk, beside other requests, with a prefix-cache
hit on hand, through preemption, with n = 2, in the overlapped and the serial loop."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_jax import LLM, RequestOutputKind, SamplingParams
from tests.engine.conftest import make_prompts
from tests.helpers.hf import hf_logits

# chunks of at most 16 tokens: a prompt of 45 is scored over three steps
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              token_buckets=[8, 16], seq_buckets=[4], show_progress=False)


def _reference(model, prompt) -> np.ndarray:
    logits = hf_logits(model, np.array([prompt]))[0].astype(np.float64)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _check(entries, prompt, ref, k):
    assert entries[0] is None and len(entries) == len(prompt)
    for i, entry in enumerate(entries[1:], start=1):
        token = prompt[i]
        assert abs(entry[token].logprob - ref[i - 1][token]) < 1e-4, i
        assert entry[token].rank == 1 + int(np.sum(ref[i - 1] > ref[i - 1][token] + 1e-6))
        assert set(np.argsort(-ref[i - 1])[:k]) <= set(entry)


@pytest.fixture(scope="module")
def llm(tiny_ckpt, compile_cache):
    return LLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache,
               enable_prefix_caching=True, **ENGINE)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_chunked_prompts_beside_others_equal_a_full_forward(tiny_ckpt, compile_cache,
                                                            async_scheduling):
    llm = LLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache,
              async_scheduling=async_scheduling, **ENGINE)
    prompts = make_prompts([45, 12, 30], seed=21)
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
              SamplingParams(temperature=0, max_tokens=6),  # no scoring: none returned
              SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _check(outs[0].prompt_logprobs, prompts[0], _reference(tiny_ckpt[1], prompts[0]), 3)
    _check(outs[2].prompt_logprobs, prompts[2], _reference(tiny_ckpt[1], prompts[2]), 0)
    assert outs[1].prompt_logprobs is None
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=3))
    assert [o.outputs[0].token_ids for o in outs][2] == plain[2].outputs[0].token_ids


def test_a_cached_prefix_is_computed_again_for_its_logprobs(llm, tiny_ckpt):
    shared = make_prompts([40], seed=3)[0]
    first = llm.generate({"prompt_token_ids": shared + [5, 6]},
                         SamplingParams(temperature=0, max_tokens=2))[0]
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate({"prompt_token_ids": shared + [7, 8]},
                         SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert llm.stats()["prefix_cache_hits"] == hits  # its prefill skipped the cache
    prompt = shared + [7, 8]
    _check(again.prompt_logprobs, prompt, _reference(tiny_ckpt[1], prompt), 1)
    assert first.num_cached_tokens == 0


@pytest.mark.slow  # the scheduler's preemption and n, the same on every JAX
def test_preempted_and_n2_requests_score_each_position_once(tiny_ckpt, compile_cache):
    # 8 pages of 16 tokens for four 40-token prompts growing to 70: they preempt each other
    llm = LLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache,
              num_gpu_blocks_override=9, enable_prefix_caching=False, **ENGINE)
    prompts = make_prompts([40, 38, 41, 39], seed=8)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True,
                            prompt_logprobs=2, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.stats()["num_preemptions"] > 0
    for out, prompt in zip(outs, prompts):
        _check(out.prompt_logprobs, prompt, _reference(tiny_ckpt[1], prompt), 2)


def test_a_streamed_request_gets_them_once_in_its_first_output(llm, tiny_ckpt):
    prompt = make_prompts([33], seed=5)[0]
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=4, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "s"]
    _check(outputs[0].prompt_logprobs, prompt, _reference(tiny_ckpt[1], prompt), 1)
    assert all(o.prompt_logprobs is None for o in outputs[1:])


def test_scoring_steps_compile_once_per_shape(llm):
    prompt = make_prompts([20], seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    llm.generate({"prompt_token_ids": prompt}, params)
    compiled = llm.stats()["num_compiles"]
    llm.generate({"prompt_token_ids": prompt[::-1]}, params)
    assert llm.stats()["num_compiles"] == compiled
