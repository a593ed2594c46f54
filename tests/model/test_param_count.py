"""Parameter counts of the real presets from abstract shapes (jax.eval_shape): no memory."""

import jax
import numpy as np
import pytest
from flax import nnx

from qwen_jax.config import ModelConfig
from qwen_jax.model import Qwen3ForCausalLM
from qwen_jax.params import abstract_model
from qwen_jax.planner import param_count


@pytest.mark.parametrize("preset, expected", [
    ("qwen3-30b-a3b", 30.5e9),
    ("qwen3-235b-a22b", 235e9),
    ("qwen3-0.6b", 0.6e9),
])
def test_param_count_of_presets(preset, expected):
    assert param_count(ModelConfig.from_hf(preset)) == pytest.approx(expected, rel=0.01)


def test_abstract_model_allocates_nothing():
    cfg = ModelConfig.from_hf("qwen3-235b-a22b")
    before = {id(x) for x in jax.live_arrays()}
    model = abstract_model(cfg, "bfloat16", model_cls=Qwen3ForCausalLM)
    new = [x for x in jax.live_arrays() if id(x) not in before]
    assert sum(x.nbytes for x in new) < 1 << 20
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert {x.dtype for x in leaves} == {np.dtype("bfloat16")}


def test_abstract_shapes_of_30b_moe_layers():
    cfg = ModelConfig.from_hf("qwen3-30b-a3b")
    stack = abstract_model(cfg, model_cls=Qwen3ForCausalLM).segments[0]
    assert stack.mlp.gate.shape == (48, 2048, 128)  # [X, D, E]
    assert stack.mlp.gate_up_proj.shape == (48, 128, 2048, 2, 768)  # [X, E, D, 2, F]
    assert stack.mlp.down_proj.shape == (48, 128, 768, 2048)  # [X, E, F, D]
    assert stack.self_attn.q_proj.kernel.shape == (48, 2048, 32 * 128)
    assert stack.self_attn.k_proj.kernel.shape == (48, 2048, 4 * 128)
