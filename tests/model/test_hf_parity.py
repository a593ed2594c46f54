"""float32 logits of our model vs HF transformers (PyTorch CPU) on tiny random configs."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qwen_jax import Qwen3ForCausalLM
from tests.helpers.hf import hf_logits, save_hf_model


@nnx.jit
def forward(model, input_ids):
    return model(input_ids)

CONFIGS = {
    "all_moe_norm_topk": dict(moe=True, norm_topk_prob=True, num_hidden_layers=3),
    "mixed_mlp_only_layers": dict(moe=True, mlp_only_layers=[0, 2], num_hidden_layers=4),
    "sparse_step_2_no_norm": dict(moe=True, decoder_sparse_step=2, norm_topk_prob=False,
                                  num_hidden_layers=4),
    "tied_embeddings": dict(moe=True, tie_word_embeddings=True),
    "head_dim_16_gqa_1": dict(moe=True, head_dim=16, num_attention_heads=4, num_key_value_heads=4),
    "gqa_4_attention_bias": dict(moe=True, num_attention_heads=8, num_key_value_heads=2,
                                 attention_bias=True),
    "yarn_rope": dict(moe=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                 "factor": 4.0,
                                                 "original_max_position_embeddings": 128}),
    "dense_qwen3_gqa_2": dict(moe=False, num_hidden_layers=3),
    "dense_qwen3_tied": dict(moe=False, tie_word_embeddings=True, num_key_value_heads=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf(tmp_path, name):
    hf_model = save_hf_model(tmp_path, **CONFIGS[name])
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype="float32")
    rng = np.random.default_rng(0)
    for batch, length in ((1, 1), (2, 17), (1, 40)):
        ids = rng.integers(0, 96, size=(batch, length), dtype=np.int32)
        ours = np.asarray(forward(model, jnp.asarray(ids)))
        ref = hf_logits(hf_model, ids)
        assert ours.shape == ref.shape == (batch, length, 96)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0,
                                   err_msg=f"{name} batch={batch} length={length}")


def test_bf16_checkpoint_loads_close_to_hf(tmp_path):
    import torch
    hf_model = save_hf_model(tmp_path, dtype=torch.bfloat16)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype="float32")
    ids = np.arange(12, dtype=np.int32)[None]
    ref = hf_logits(hf_model.float(), ids)
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids))), ref, atol=1e-4,
                               rtol=0)
