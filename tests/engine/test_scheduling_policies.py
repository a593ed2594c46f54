"""Greedy outputs on the tiny model are the same for every request whatever the scheduling:
each policy, preemption by recompute or by swap to host memory, long requests preempted
for short ones."""

import pytest

from qwen_jax import SamplingParams
from serving.engine.config import engine_config_from_kwargs
from serving.engine.llm_engine import LLMEngine
from tests.engine.conftest import make_prompts

LONG = make_prompts([70, 60], seed=11)
SHORT = make_prompts([5, 9, 12, 7], seed=12)
ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, token_buckets=[8, 64],
            seq_buckets=[4, 8], show_progress=False, enable_prefix_caching=False,
            length_buckets=[16, 48], aging_interval=100.0, boost_wait=float("inf"),
            num_gpu_blocks_override=9)  # 8 usable pages: the long requests alone grow to 11


def run(tiny_ckpt, compile_cache, **kwargs):
    """Two long requests start, four short ones arrive two steps later."""
    engine = LLMEngine(engine_config_from_kwargs(
        str(tiny_ckpt[0]), compilation_cache_dir=compile_cache, **{**ARGS, **kwargs}))
    compiles = engine.stats()["num_compiles"]
    outputs = {}
    for i, prompt in enumerate(LONG):
        engine.add_request(f"long{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(2):
        engine.step()
    for i, prompt in enumerate(SHORT):
        engine.add_request(f"short{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    stats = engine.stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]  # no page leaked
    assert stats["num_used_host_pages"] == 0 and stats["num_swapped_requests"] == 0
    assert stats["num_compiles"] == compiles  # swaps compile nothing while serving
    return outputs, stats


@pytest.fixture(scope="module")
def fcfs(tiny_ckpt, compile_cache):
    """One request at a time: nothing is preempted."""
    outputs, stats = run(tiny_ckpt, compile_cache, max_num_seqs=1)
    assert stats["num_preemptions"] == 0 and len(outputs) == 6
    return outputs


@pytest.mark.parametrize("policy, swap_space, max_num_seqs", [
    ("fcfs", 0, 4), ("fcfs", 0.01, 4), ("priority", 0, 4), ("length-aware", 0, 2),
    ("length-aware", 0.01, 2),
])
def test_greedy_outputs_match_fcfs_under_every_policy_and_preemption_mode(
        tiny_ckpt, compile_cache, fcfs, policy, swap_space, max_num_seqs):
    outputs, stats = run(tiny_ckpt, compile_cache, policy=policy, swap_space=swap_space,
                         swap_min_tokens=0, max_num_seqs=max_num_seqs,
                         short_preempt_wait=0.0)
    assert outputs == fcfs
    assert stats["num_preemptions"] > 0
    if swap_space:
        assert stats["num_swap_outs"] == stats["num_swap_ins"] == stats["num_preemptions"]
        assert stats["num_recomputed_tokens"] == 0
    else:
        assert stats["num_swap_outs"] == 0 and stats["num_recomputed_tokens"] > 0
