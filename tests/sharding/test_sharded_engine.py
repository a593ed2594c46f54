"""On 8 simulated CPU devices: TP, EP, TP x EP and DP x TP layouts give the single-device
greedy tokens, and every weight and the KV cache are sharded as the table says."""

import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from qwen_jax import LLM, SamplingParams
from qwen_jax.sharding import param_logical_axes, spec_for
from tests.helpers.eagle3 import write_eagle3_dir
from tests.helpers.hf import save_hf_model

ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, token_buckets=[64],
            seq_buckets=[4], show_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp8_replicated_kv_heads": dict(tensor_parallel_size=8),
    "ep4": dict(expert_parallel_size=4),
    "tp2_ep4": dict(tensor_parallel_size=2, expert_parallel_size=4),
    "dp2_tp4": dict(data_parallel_size=2, tensor_parallel_size=4),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("shard-moe")
    save_hf_model(path, moe=True, num_hidden_layers=3, mlp_only_layers=[0],
                  num_attention_heads=8, num_key_value_heads=2, num_experts=8,
                  moe_intermediate_size=16, intermediate_size=32, vocab_size=96, seed=5)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(2, 96, size=n).tolist()} for n in (3, 21, 40, 7)]


@pytest.fixture(scope="module")
def single_device(ckpt, prompts, tmp_path_factory):
    llm = LLM(ckpt, compilation_cache_dir=None, **ARGS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_eight_devices_are_simulated():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_device_tokens(ckpt, prompts, single_device, layout):
    llm = LLM(ckpt, compilation_cache_dir=None, **ARGS, **LAYOUTS[layout])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == single_device
    stats = llm.stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_speculative_decoding_under_tp_x_ep_matches_single_device_tokens(
        ckpt, prompts, single_device, method, tmp_path):
    # rows for the 4 sequences and their drafts: a sequence bucket of 16; the draft model
    # is the target itself, sharded as it is; the EAGLE-3 head (random) is replicated and
    # its K/V sharded by kv head as the target's, reading the target's kept hidden states
    args = {**ARGS, "max_num_seqs": 16, "seq_buckets": [16]}
    model = {"draft_model": ckpt, "eagle3": str(tmp_path)}.get(method)
    if method == "eagle3":
        write_eagle3_dir(tmp_path, vocab_size=96, target_hidden_size=32, num_target_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=8, aux_layers=(0, 1, 2))
    llm = LLM(ckpt, compilation_cache_dir=None, **args, **LAYOUTS["tp2_ep4"],
              speculative_config={"method": method, "num_speculative_tokens": 3,
                                  "adaptive_draft_length": False,
                                  **({"model": model} if model else {})})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == single_device
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_free_pages"] == stats["num_total_pages"]


def _param_specs(model):
    cfg = model.config
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        yield path, value, spec_for(param_logical_axes(path), value.shape, model.mesh,
                                    cfg.num_key_value_heads)


def test_tp2_ep4_shardings_follow_the_table(ckpt):
    llm = LLM(ckpt, compilation_cache_dir=None, precompile=False, **ARGS,
              **LAYOUTS["tp2_ep4"])
    model = llm.llm_engine.model
    seen = {}
    for path, value, expected in _param_specs(model):
        assert value.sharding.spec == expected, path
        seen["/".join(map(str, path))] = value.sharding.spec
    assert seen["embed_tokens"] == P("model", None)
    assert seen["segments/1/mlp/gate_up_proj"] == P(None, "expert", None, None, "model")
    assert seen["segments/1/mlp/down_proj"] == P(None, "expert", "model", None)
    assert seen["segments/1/self_attn/q_proj/kernel"] == P(None, None, "model")
    assert seen["segments/0/mlp/down_proj/kernel"] == P(None, "model", None)
    for k, v in llm.llm_engine.runner.kv_caches:
        for cache in (k, v):
            assert cache.sharding.spec == P(None, None, "model", None)
            # Each device holds its kv head only: never the whole cache.
            assert {s.data.shape[2] for s in cache.addressable_shards} == {1}


def test_tp8_replicates_kv_head_weights_and_splits_the_cache(ckpt):
    llm = LLM(ckpt, compilation_cache_dir=None, precompile=False, **ARGS,
              **LAYOUTS["tp8_replicated_kv_heads"])
    engine = llm.llm_engine
    layer = engine.model.segments[0].self_attn
    assert layer.k_proj.kernel[...].sharding.spec == P(None, None, None)
    assert layer.q_proj.kernel[...].sharding.spec == P(None, None, "model")
    k_cache = engine.runner.kv_caches[0][0]
    assert k_cache.shape[2] == 8  # 2 kv heads, 4 copies each: one per device
    assert {s.data.shape[2] for s in k_cache.addressable_shards} == {1}
    assert len({s.device for s in k_cache.addressable_shards}) == 8


def test_bad_layouts_name_the_field(ckpt):
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(ckpt, compilation_cache_dir=None, precompile=False, tensor_parallel_size=3, **ARGS)
    with pytest.raises(ValueError, match="exceeds the 8 devices"):
        LLM(ckpt, compilation_cache_dir=None, precompile=False, tensor_parallel_size=4,
            data_parallel_size=4, **ARGS)


def test_structured_outputs_under_tensor_parallelism():
    """The mask goes to every device like the other step inputs: TP=2 samples what one
    device samples under the same grammar (the embedded model has a tokenizer)."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12,
                             structured_outputs={"regex": "[0-9]{2,6}( [a-z]+)?"})
              for s in range(3)]
    texts = []
    for layout in ({}, {"tensor_parallel_size": 2}):
        llm = LLM(compilation_cache_dir=None, **ARGS, **layout)
        texts.append([o.outputs[0].text for o in llm.generate(["Sort the list: 3 1"] * 3,
                                                              params)])
    assert texts[0] == texts[1]
    assert all(re.fullmatch("[0-9]{2,6}( [a-z]+)?", t) for t in texts[0])


def test_prompt_logprobs_under_tp_x_ep_match_single_device(ckpt, prompts):
    # the scored prompt rows' lm head and log-softmax over the sharded weights
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    one = LLM(ckpt, compilation_cache_dir=None, **ARGS).generate(prompts, params)
    many = LLM(ckpt, compilation_cache_dir=None, **ARGS, **LAYOUTS["tp2_ep4"]).generate(
        prompts, params)
    for a, b in zip(one, many):
        assert len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            for token in x:
                assert abs(x[token].logprob - y[token].logprob) < 1e-4
