"""The model's public functions declare their shapes with jaxtyping, in the einsum
alphabet (qwen_jax/layers.py); a runtime checker (jaxtyped + beartype, in tests only)
holds every argument and result to them, also while jit traces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from flax import nnx
from jaxtyping import TypeCheckError, jaxtyped

from qwen_jax.config import ModelConfig
from qwen_jax.model import Qwen3ForCausalLM, contiguous_metadata

CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32,
              intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, mlp_only_layers=[0])


def checked(fn):
    return jaxtyped(typechecker=beartype)(fn)


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM(ModelConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


def test_full_sequence_call_shapes_hold(model):
    logits = checked(Qwen3ForCausalLM.__call__)(model, np.zeros((2, 5), np.int32))
    assert logits.shape == (2, 5, 64)
    with pytest.raises(TypeCheckError, match="input_ids"):
        checked(Qwen3ForCausalLM.__call__)(model, np.zeros((2, 5), np.float32))


def test_serving_forward_shapes_hold_under_jit(model):
    meta, num_pages = contiguous_metadata(2, 4, page_size=4)
    caches = model.init_kv_caches(num_pages, 4)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, token_ids, positions, caches, meta):
        return checked(Qwen3ForCausalLM.forward)(nnx.merge(graphdef, state), token_ids,
                                                 positions, caches, meta)

    tokens = jnp.arange(8, dtype=jnp.int32)
    hidden, _ = forward(state, tokens, tokens % 4, caches, meta)
    assert hidden.shape == (8, 32)
    with pytest.raises(TypeCheckError, match="positions"):
        forward(state, tokens, tokens[:6], caches, meta)


def test_logits_keep_the_leading_dims(model):
    compute = checked(Qwen3ForCausalLM.compute_logits)
    assert compute(model, jnp.zeros((3, 7, 32))).shape == (3, 7, 64)
    with pytest.raises(TypeCheckError, match="hidden"):
        compute(model, jnp.zeros((3, 16), jnp.int32))
