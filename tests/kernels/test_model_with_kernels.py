"""The model and the engine with impl="pallas" (kernels run interpreted on CPU) give the
reference path's results: the kernels are wired with the right page offsets, GQA groups
and padding, not only correct in isolation."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from qwen_jax import LLM, Qwen3ForCausalLM, SamplingParams
from tests.helpers.hf import hf_logits, save_hf_model

_real_ops = pallas_kernels.ops


def _interpreted_ops(impl=None):
    return pallas_kernels.interpreted(_real_ops(impl))


@pytest.fixture()
def interpreted(monkeypatch):
    monkeypatch.setattr(pallas_kernels, "ops", _interpreted_ops)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernel-moe")
    model = save_hf_model(path, moe=True, num_hidden_layers=2, mlp_only_layers=[0],
                          num_attention_heads=8, num_key_value_heads=2, head_dim=16, seed=3)
    return path, model


def test_model_logits_with_kernels_match_hf(ckpt, interpreted):
    model = Qwen3ForCausalLM.from_pretrained(ckpt[0], impl="pallas")
    assert model.impl == "pallas"
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 21)).astype(np.int32)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))
    np.testing.assert_allclose(logits, hf_logits(ckpt[1], ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_with_kernels_matches_reference_engine(ckpt, interpreted, kv_cache_dtype):
    # fp8: the kernels get the cache's per-kv-head scales (written and read with them).
    args = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96,
                token_buckets=[32], seq_buckets=[4], compilation_cache_dir=None,
                show_progress=False, kv_cache_dtype=kv_cache_dtype)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(2, 96, size=n).tolist()} for n in (3, 40, 17)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kernel_llm = LLM(str(ckpt[0]), impl="pallas", **args)
    if kv_cache_dtype == "fp8":
        assert kernel_llm.llm_engine.runner.kv_caches[0][0].dtype == jnp.float8_e4m3fn
    kernels = kernel_llm.generate(prompts, params)
    reference = LLM(str(ckpt[0]), impl="reference", **args).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in kernels] == \
        [o.outputs[0].token_ids for o in reference]
