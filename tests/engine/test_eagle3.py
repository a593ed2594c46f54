"""EAGLE-3 heads (qwen_jax/eagle3.py, serving/executor/eagle_runner.py): loaded from the
published layout, numerics against a PyTorch forward built from the description,
heads that do not fit the target refused by field, and the engine with the shipped
head (the greedy identity in every scheduling mode is in test_speculative_decoding.py)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from qwen_jax import LLM, SamplingParams, tasks
from qwen_jax.attention import step_context
from qwen_jax.config import ModelConfig
from qwen_jax.eagle3 import load_eagle3
from qwen_jax.layers import Runtime
from qwen_jax.model import contiguous_metadata
from serving.bench.eval_tasks import TINY_MODEL, chat_template, generate_texts, render_prompts
from tests.helpers.eagle3 import torch_eagle3_forward, write_eagle3_dir

TARGET = ModelConfig.from_hf(TINY_MODEL)  # hidden 128, 4 layers, 896 tokens
HEAD = dict(vocab_size=TARGET.vocab_size, target_hidden_size=TARGET.hidden_size,
            num_target_layers=TARGET.num_hidden_layers, num_heads=4, num_kv_heads=2,
            head_dim=16, draft_vocab_size=320, aux_layers=(0, 1, 3))


def _run_head(head, embeds, aux):
    """Our head over one whole sequence on the paged cache: (normed, pre-norm) [T, D]."""
    num = embeds.shape[0]
    meta, num_pages = contiguous_metadata(1, num, 16)
    cfg, rt = head.config, Runtime("reference", None)
    ctx = step_context(meta, jnp.arange(num, dtype=jnp.int32),
                       (head.rope_inv_freq[...], head.rope_scale), dtype=jnp.float32,
                       num_q_heads=cfg.num_attention_heads,
                       num_kv_heads=head.num_cache_kv_heads, head_dim=cfg.head_dim, rt=rt)
    normed, prenorm, _ = head(jnp.asarray(embeds), head.fc(jnp.asarray(aux)),
                              head.init_kv_cache(num_pages, 16), ctx, rt)
    return normed, prenorm


@pytest.mark.parametrize("prefix, architecture", [
    ("midlayer.", "LlamaForCausalLMEagle3"), ("model.layers.0.", "Eagle3LlamaForCausalLM")])
def test_a_published_head_loads_and_matches_a_torch_forward(tmp_path, prefix, architecture):
    tensors = write_eagle3_dir(tmp_path, prefix=prefix, architecture=architecture, **HEAD)
    head = load_eagle3(tmp_path, TARGET, jnp.float32)
    assert head.config.aux_layer_ids == (0, 1, 3)
    assert head.config.draft_vocab_size == 320 and head.embed_tokens is None
    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((21, 128)).astype(np.float32)
    aux = rng.standard_normal((21, 3 * 128)).astype(np.float32)
    normed, prenorm = _run_head(head, embeds, aux)
    hidden = torch.from_numpy(aux) @ tensors["fc.weight"].T
    want_logits, want_prenorm = torch_eagle3_forward(
        tensors, torch.from_numpy(embeds), hidden, num_heads=4, num_kv_heads=2, head_dim=16,
        prefix=prefix)
    np.testing.assert_allclose(np.asarray(normed @ head.lm_head[...]), want_logits.numpy(),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(prenorm), want_prenorm.numpy(), rtol=1e-4, atol=1e-4)
    # drafts come back as target ids: draft id d is target id d + d2t[d]
    best = want_logits.argmax(-1)
    got = np.asarray(head.draft_tokens(normed))
    np.testing.assert_array_equal(got, (best + tensors["d2t"][best]).numpy())
    assert tensors["t2d"][torch.tensor(got.tolist())].all()


def test_the_aux_layers_default_to_vllms_choice(tmp_path):
    write_eagle3_dir(tmp_path, **{**HEAD, "aux_layers": None})
    head = load_eagle3(tmp_path, TARGET, jnp.float32)
    assert head.config.aux_layer_ids == (2, 2, 1)  # (2, L // 2, L - 3) for 4 layers


@pytest.mark.parametrize("overrides, match", [
    ({"target_hidden_size": 64},
     "speculative_config.model's target_hidden_size must be the target's hidden_size 128"),
    ({"vocab_size": 512}, "speculative_config.model's vocab_size must be the target's "
                          "vocab_size 896"),
    ({"hidden_size": 96}, "speculative_config.model's hidden_size must be the target's "
                          "hidden_size 128 \\(the head has no embed_tokens"),
    ({"aux_layers": (0, 1, 4)}, "eagle_aux_hidden_state_layer_ids must be three layer ids "
                                "in \\[0, 4\\)"),
    ({"architecture": "MedusaModel"}, "speculative_config.model's architectures must be one "
                                      "of LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM"),
    ({"num_hidden_layers": 2}, "num_hidden_layers must be 1"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_by_field(tmp_path, overrides, match):
    write_eagle3_dir(tmp_path, **{**HEAD, **overrides})
    with pytest.raises(ValueError, match=match):
        load_eagle3(tmp_path, TARGET, jnp.float32)


def test_a_head_with_its_own_embeddings_may_be_narrower(tmp_path):
    write_eagle3_dir(tmp_path, **{**HEAD, "hidden_size": 96, "embeddings": True})
    head = load_eagle3(tmp_path, TARGET, jnp.float32)
    assert head.embed_tokens[...].shape == (896, 96) and head.fc.kernel.shape == (384, 96)


def test_a_missing_tensor_is_named(tmp_path):
    write_eagle3_dir(tmp_path, **HEAD)
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="to include midlayer.hidden_norm.weight"):
        load_eagle3(tmp_path, TARGET, jnp.float32)


def _prompts(task_names, per_task):
    problems = [p for t in task_names for p in tasks.problems(t, per_task, seed=5)]
    return render_prompts(problems, chat_template(TINY_MODEL))


@pytest.mark.slow
def test_the_embedded_model_drafts_with_its_shipped_head():
    # {"method": "eagle3"} without a model: qwen_jax/assets/tiny-qwen3-eagle3, trained on
    # the tiny model's tasks by scripts/train_eagle3.py
    config = json.loads((TINY_MODEL.with_name("tiny-qwen3-eagle3") / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    prompts = _prompts(tasks.TASKS, 2)
    # few buckets: a cold start compiles every one, the target's and the proposer's
    few = dict(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[8, 64],
               seq_buckets=[2, 8], enable_prefix_caching=False)
    plain = LLM(model=str(TINY_MODEL), precompile=False, show_progress=False, **few)
    llm = LLM(model=str(TINY_MODEL), show_progress=False, **few,
              speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                  "adaptive_draft_length": False})
    compiled = llm.stats()["num_compiles"]
    assert compiled == 2 * len(llm.llm_engine.bucket_pairs)  # the target's and the head's
    assert generate_texts(llm, prompts) == generate_texts(plain, prompts)
    stats = llm.stats()
    assert stats["num_compiles"] == compiled
    assert stats["spec_decode_mean_acceptance_length"] > 2.5
    assert stats["num_used_pages"] == 0


def test_sampled_requests_with_eagle3_equal_the_plain_engine():
    prompts = _prompts(("reverse", "add"), 2)
    params = [SamplingParams(temperature=0.7, top_k=10, seed=seed, max_tokens=40,
                             ignore_eos=True) for seed in range(4)]
    # 4 sequences, 3 drafts each: 16 rows; a bucket for the prompts and one for decoding
    few = dict(max_num_seqs=4, token_buckets=[16, 512], seq_buckets=[16],
               enable_prefix_caching=False, precompile=False, show_progress=False)
    plain = LLM(model=str(TINY_MODEL), **few).generate(prompts, params)
    llm = LLM(model=str(TINY_MODEL), **few,
              speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                  "adaptive_draft_length": False})
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain])
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_model_drafts_are_refused_with_several_processes(monkeypatch):
    from serving.executor import distributed
    monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
    with pytest.raises(ValueError, match="speculative_config.method must be ngram with "
                                         "several processes"):
        LLM(model=str(TINY_MODEL), precompile=False, show_progress=False,
            speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
