"""Pipeline parallelism on 8 simulated CPU devices: PP2, PP2 x TP2 and PP2 x EP2 x TP2 give
the single-device greedy tokens, every device holds only its stage's layers and their KV
pages, and what the stages do not run with yet is refused by name."""

import jax
import numpy as np
import pytest

from qwen_jax import LLM, SamplingParams
from tests.helpers.hf import save_hf_model

ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, token_buckets=[64],
            seq_buckets=[4], show_progress=False, compilation_cache_dir=None)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LAYOUTS = {
    "pp2": dict(pipeline_parallel_size=2),
    "pp2_tp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2),
    "pp2_ep2_tp2": dict(pipeline_parallel_size=2, expert_parallel_size=2,
                        tensor_parallel_size=2),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Two dense layers, then two MoE layers: each stage holds one of each."""
    path = tmp_path_factory.mktemp("pp-moe")
    save_hf_model(path, moe=True, num_hidden_layers=4, mlp_only_layers=[0, 1],
                  num_attention_heads=8, num_key_value_heads=2, num_experts=8,
                  moe_intermediate_size=16, intermediate_size=32, vocab_size=96, seed=5)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    # the last repeats the first: a prefix-cache hit over both stages' pages
    ids = [rng.integers(2, 96, size=n).tolist() for n in (3, 21, 40, 7)]
    return [{"prompt_token_ids": p} for p in (*ids, ids[2] + [5, 6])]


@pytest.fixture(scope="module")
def single_device(ckpt, prompts):
    llm = LLM(ckpt, **ARGS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stages_give_the_single_device_tokens(ckpt, prompts, single_device, layout):
    llm = LLM(ckpt, **ARGS, **LAYOUTS[layout])
    outputs = llm.generate(prompts[:4], GREEDY)
    outputs += llm.generate(prompts[4:], GREEDY)  # after the others: its prefix is cached
    assert [o.outputs[0].token_ids for o in outputs] == single_device
    assert outputs[-1].num_cached_tokens >= 32
    stats = llm.stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


def test_a_pool_that_preempts_and_prompt_logprobs_keep_the_single_device_results(
        ckpt, prompts, single_device):
    """Preempted sequences whose tokens were in flight recompute; the prompt rows a batch
    scores come back with it as it leaves the pipeline."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    small = dict(ARGS, block_size=4, num_gpu_blocks_override=15, kv_plan_limit=1.0)
    reference = LLM(ckpt, **ARGS).generate(prompts[:4], params)
    llm = LLM(ckpt, **small, pipeline_parallel_size=2)
    outputs = llm.generate(prompts[:4], params)
    assert [o.outputs[0].token_ids for o in outputs] == single_device[:4]
    assert llm.stats()["num_preemptions"] > 0
    for got, want in zip(outputs, reference):
        assert [None if lp is None else sorted(lp) for lp in got.prompt_logprobs] == [
            None if lp is None else sorted(lp) for lp in want.prompt_logprobs]
        for lp_got, lp_want in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            for token in lp_want:
                assert lp_got[token].logprob == pytest.approx(lp_want[token].logprob, abs=1e-4)
    stats = llm.stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


@pytest.mark.parametrize("overlap, num_requests", [(False, 8), (True, 10)],
                         ids=["serial", "overlapped"])
def test_at_steady_decode_no_stage_idles(ckpt, overlap, num_requests):
    """2 stages x 2 segments: 4 batches in flight, and overlapped a fifth whose tokens the
    host reads while the next tick runs. With 2 requests per batch every tick after the
    fill (3 ticks) and before the drain (3) has all 4 slots busy; the idle stage-ticks
    are the fill's and the drain's alone."""
    args = {**ARGS, "max_num_seqs": 16, "seq_buckets": [16], "async_scheduling": overlap}
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(2, 96, size=5).tolist()}
               for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(ckpt, **args, pipeline_parallel_size=2)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens == [o.outputs[0].token_ids for o in LLM(ckpt, **args).generate(prompts, params)]
    loop = llm.llm_engine.pipeline
    groups, occupancy = loop.groups, list(loop.occupancy)
    assert (loop.depth, groups) == (4, 5 if overlap else 4)
    # each group of 2: a prefill, then 5 decodes `groups` ticks apart, the groups entering
    # one tick apart; the last batch leaves 3 ticks after it entered
    num_ticks = (num_requests // 2 - 1) + 5 * groups + 4
    assert occupancy == [1, 2, 3] + [4] * (num_ticks - 6) + [3, 2, 1]
    stats = llm.stats()
    assert stats["pipeline_ticks"] == num_ticks
    assert stats["pipeline_idle_slots"] == 2 * (1 + 2 + 3)
    # stage 0 runs slots 0 and 2, stage 1 slots 1 and 3: in the fill's first tick (slot 0
    # only) stage 1 idles, and in the drain's last tick (slot 3 only) stage 0 does
    assert stats["pipeline_idle_stage_ticks"] == 2
    assert stats["pipeline_bubble_fraction"] == pytest.approx(12 / (4 * num_ticks))


def _tensor(shape, dtype="f32") -> str:
    return "tensor<" + "x".join(map(str, shape)) + f"x{dtype}>"


def test_the_lowered_tick_of_each_stage_holds_only_its_layers(ckpt):
    """Inside the tick's shard_map over `stage` (the lowered module's manual computation)
    every stacked weight holds one of its segment's two layers, every cache a stage's
    pages, the carry a stage's hidden states."""
    import re

    llm = LLM(ckpt, precompile=False, **ARGS, pipeline_parallel_size=2)
    runner = llm.llm_engine.runner
    text = runner._step.lower(runner.state, runner.kv_caches,
                              *runner._abstract_args((64, 4))).as_text()
    bodies = re.findall(r'manual_axes=\{"stage"\} \(([^{]*)\)', text)
    assert len(bodies) == 1  # one shard_map: the tick
    local = re.findall(r"tensor<[^>]*>", bodies[0])
    stacked = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(runner.state)[0]
               if "segments" in jax.tree_util.keystr(path)]
    assert stacked and all(leaf.shape[0] == 2 for leaf in stacked)
    for leaf in stacked:
        assert _tensor((1, *leaf.shape[1:])) in local
        assert _tensor(leaf.shape) not in local
    for cache in jax.tree.leaves(runner.kv_caches):
        assert _tensor((cache.shape[0] // 2, *cache.shape[1:])) in local
        assert _tensor(cache.shape) not in local
    assert _tensor((1, *runner.carry.shape[1:])) in local


def test_the_tick_lowers_for_cuda_with_the_pallas_kernels(tmp_path):
    """PP2 x TP2 with the Triton kernels (head dim and expert widths the tiles take),
    lowered for CUDA on this CPU: one shard_map over `stage`, the ragged paged attention
    and the grouped matmuls inside the stages."""
    import re

    from pallas_kernels.cuda_lowering import cuda_lowering_context

    save_hf_model(tmp_path, moe=True, num_hidden_layers=4, mlp_only_layers=[0, 1],
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8,
                  moe_intermediate_size=32, intermediate_size=64, vocab_size=96, seed=5)
    llm = LLM(str(tmp_path), precompile=False, impl="pallas", **ARGS,
              pipeline_parallel_size=2, tensor_parallel_size=2)
    engine = llm.llm_engine
    runner = engine.runner
    with cuda_lowering_context(engine.mesh):
        text = runner._step.trace(runner.state, runner.kv_caches,
                                  *runner._abstract_args((64, 4))).lower(
            lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r'manual_axes=\{"stage"\}', text)) == 1
    kernels = re.findall(r'xla.gpu.triton.*?name = "([a-z_]+)"', text)
    assert "ragged_paged_attention" in kernels and "grouped_matmul" in kernels


@pytest.mark.parametrize("option, value, field", [
    ("speculative_config", {"method": "draft_model", "num_speculative_tokens": 2},
     "speculative_config"),
    ("enable_lora", True, "enable_lora"),
    ("swap_space", 1, "swap_space"),
])
def test_what_stages_do_not_run_with_yet_is_refused_by_name(ckpt, option, value, field):
    if option == "speculative_config":
        value = {**value, "model": ckpt}
    with pytest.raises(ValueError, match=f"pipeline_parallel_size=2 needs {field}"):
        LLM(ckpt, precompile=False, pipeline_parallel_size=2, **{**ARGS, option: value})


def test_a_stage_count_that_does_not_divide_the_layers_is_refused(ckpt):
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 must divide the 2 "
                                         "consecutive dense layers from layer 0"):
        LLM(ckpt, precompile=False, pipeline_parallel_size=4, **ARGS)
