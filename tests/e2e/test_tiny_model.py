"""The shipped tiny Qwen3-MoE: HF-loadable, HF-equal answers, and the same per-problem
correctness through every engine configuration (a difference is a serving bug)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qwen_jax import tasks
from serving.bench.eval_tasks import (
    TINY_MODEL,
    chat_template,
    evaluate,
    final_answer,
    generate_texts,
    render_prompts,
)
from tests.helpers.fixtures import QWEN3_TOKENIZER
from tiny_greedy import FullForwardLLM, eos_ids, hf_greedy_ids

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
N_PER_TASK = 3


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture(scope="module")
def full_forward():
    return FullForwardLLM(TINY_MODEL)


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32).eval()


def test_tokenizer_has_qwen3_special_tokens(hf_tokenizer):
    vocab = hf_tokenizer.get_vocab()
    for token in SPECIAL:
        assert token in vocab
        assert hf_tokenizer.encode(token) == [vocab[token]]  # never split into pieces
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"
    config = json.loads((TINY_MODEL / "config.json").read_text())
    assert config["vocab_size"] >= len(vocab)
    assert vocab["<|im_end|>"] in eos_ids(TINY_MODEL)


def test_copy_codes_are_one_capital_per_token(hf_tokenizer):
    for code in ("QXBR", "YFJHMZ", "ABCDEFGH"):
        assert hf_tokenizer.tokenize(code) == list(code)


def test_chat_template_renders_qwen3_layout(hf_tokenizer):
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    rendered = hf_tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=False)
    assert rendered == ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    chat = [{"role": "system", "content": "S"}, *user, {"role": "assistant", "content": "5"}]
    assert hf_tokenizer.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n5<|im_end|>\n")


def test_chat_template_equals_qwen3s_on_plain_chats(hf_tokenizer):
    from transformers import AutoTokenizer
    qwen3 = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    chats = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
         {"role": "assistant", "content": "<think>\nr\n</think>\n\nb"},
         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
    ]
    for chat in chats:
        for kwargs in ({}, {"enable_thinking": False}):
            for gen in (True, False):
                ours = hf_tokenizer.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=gen, **kwargs)
                assert ours == qwen3.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=gen, **kwargs)


@pytest.mark.skipif(not QWEN3_TOKENIZER.exists(), reason="no Qwen3 tokenizer fixture")
def test_chat_template_equals_qwen3s_with_tools_calls_and_results(hf_tokenizer):
    from transformers import AutoTokenizer

    from qwen_jax.tool_task import TOOLS, ToolProblem
    qwen3 = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    problem = ToolProblem("tool", 385, 47)
    two_calls = problem.answer_messages()
    two_calls[1] = {**two_calls[1], "content": "Let me add.", "tool_calls":
                    two_calls[1]["tool_calls"] * 2}
    two_calls.append({"role": "tool", "tool_call_id": "call_1", "content": "432"})
    for chat in (problem.messages, problem.answer_messages(), two_calls,
                 [{"role": "system", "content": "S"}, *problem.answer_messages()]):
        for kwargs in ({}, {"enable_thinking": False}):
            ours = hf_tokenizer.apply_chat_template(chat, tools=list(TOOLS), tokenize=False,
                                                    add_generation_prompt=True, **kwargs)
            assert ours == qwen3.apply_chat_template(chat, tools=list(TOOLS), tokenize=False,
                                                     add_generation_prompt=True, **kwargs)
    assert "<tool_response>\n432\n</tool_response>" in ours and "# Tools" in ours


def _prompt_ids(full_forward, n_per_task: int) -> list[list[int]]:
    problems = [p for t in tasks.TASKS for p in tasks.problems(t, n_per_task, seed=7)]
    texts = render_prompts(problems, chat_template(TINY_MODEL))
    return [full_forward.tokenizer.encode(t).ids for t in texts]


def test_hf_logits_equal_ours(full_forward, hf_model):
    import torch
    ids = _prompt_ids(full_forward, 1)[-1]  # the long copy prompt
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(full_forward.model(np.asarray([ids], np.int32)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_hf_greedy_answers_equal_ours(full_forward, hf_model):
    prompts = _prompt_ids(full_forward, 2)
    ours = full_forward.greedy_ids(prompts)
    assert ours == hf_greedy_ids(hf_model, prompts, full_forward.eos)


def test_full_forward_answers_are_mostly_right(full_forward):
    results = evaluate(full_forward, N_PER_TASK, seed=3)
    accuracy = np.mean([c for _, correct in results.values() for c in correct])
    assert accuracy >= 0.9, results


def test_addition_thinks_ones_digit_first_then_answers(full_forward):
    """The README's example: the think block holds the sum's digits, ones first."""
    prompt = render_prompts([tasks.Problem("add", "What is 385 + 47?", "432")],
                            chat_template(TINY_MODEL))
    (text,) = generate_texts(full_forward, prompt)
    assert text == "<think>\n2 3 4\n</think>\n\n432"
    assert final_answer(text) == "432"


# ---- through the engine --------------------------------------------------------------------
# Each configuration must reproduce the full-forward greedy texts exactly, right or wrong:
# the texts include the think block, so a wrong page or position shows even when the
# final answer happens to survive it.
ENGINE_CONFIGS = {
    "all_at_once": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(enable_prefix_caching=False, max_num_seqs=4,
                            max_num_batched_tokens=32),
    "prefix_caching": dict(enable_prefix_caching=True),
}
EVAL_SEED = 5


# Few buckets (each shape a test meets compiles once, some seconds on a CPU): 12 prompts
# in one step, then 12 sequences decoding, then the last few.
BUCKETS = dict(max_num_seqs=16, token_buckets=(16, 64, 512), seq_buckets=(4, 16))


def _llm(**kwargs):
    from qwen_jax import LLM
    return LLM(model=str(TINY_MODEL), precompile=False, show_progress=False,
               **{**BUCKETS, **kwargs})


def _eval_prompts() -> list[str]:
    problems = [p for t in tasks.TASKS for p in tasks.problems(t, N_PER_TASK, seed=EVAL_SEED)]
    return render_prompts(problems, chat_template(TINY_MODEL))


@pytest.fixture(scope="module")
def reference_texts(full_forward):
    return generate_texts(full_forward, _eval_prompts())


@pytest.fixture(scope="module")
def reference_results(full_forward):
    """evaluate() of the full forward (greedy: the same every time it runs)."""
    return evaluate(full_forward, N_PER_TASK, seed=EVAL_SEED)


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINE_CONFIGS)
def test_engine_matches_full_forward_per_problem(name, reference_texts, reference_results):
    llm = _llm(**ENGINE_CONFIGS[name])
    passes = 2 if name == "prefix_caching" else 1  # the second pass hits the cache
    for _ in range(passes):
        assert generate_texts(llm, _eval_prompts()) == reference_texts
    if name == "prefix_caching":
        assert llm.stats()["prefix_cache_hits"] > 0
    # evaluate() scores the same texts: its correctness equals the reference's
    assert evaluate(llm, N_PER_TASK, seed=EVAL_SEED) == reference_results


@pytest.mark.slow
def test_engine_one_request_at_a_time_matches(reference_texts):
    llm = _llm(enable_prefix_caching=False)
    assert generate_texts(llm, _eval_prompts(), one_at_a_time=True) == reference_texts


@pytest.mark.slow
def test_engine_tiny_kv_pool_preempts_and_matches(full_forward):
    """20 pages of 16 tokens: 16 list prompts of 2 pages each are admitted, then run out of
    pages while decoding into their third page, so running requests get preempted."""
    problems = [p for t in ("reverse", "sort") for p in tasks.problems(t, 8, seed=EVAL_SEED)]
    prompts = render_prompts(problems, chat_template(TINY_MODEL))
    llm = _llm(enable_prefix_caching=False, num_gpu_blocks_override=20)
    assert generate_texts(llm, prompts) == generate_texts(full_forward, prompts)
    assert llm.stats()["num_preemptions"] > 0
