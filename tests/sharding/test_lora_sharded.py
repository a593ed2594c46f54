"""LoRA under TP x EP on 8 simulated devices, on a float and on a quantised (int8) base:
a batch mixing adapters (attention, experts, router) and none gives one device's logits.
The experts' factors split like their weights (E over `expert`, F over `model`)."""

import jax
import numpy as np
import pytest

from qwen_jax import Qwen3ForCausalLM
from qwen_jax.lora import load_adapter
from qwen_jax.lora_layers import write_slot
from qwen_jax.lora_packing import pack_adapter
from qwen_jax.sharding import make_mesh
from tests.helpers.hf import save_hf_model
from tests.helpers.lora import save_peft_adapter

# 8 heads / 4 kv heads / F=32 / E=8 split over TP=2 x EP=4.
HF = dict(moe=True, num_hidden_layers=2, mlp_only_layers=[1], num_attention_heads=8,
          num_key_value_heads=4, head_dim=8, num_experts=8, moe_intermediate_size=32,
          intermediate_size=32)
TARGETS = [["q_proj", "v_proj", "o_proj"], "all-linear"]
IDS = np.random.default_rng(1).integers(2, 96, size=(3, 11)).astype(np.int32)
SLOTS = np.array([2, 0, 1], np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp_ep")
    hf = save_hf_model(root / "base", **HF)
    for i, targets in enumerate(TARGETS):
        save_peft_adapter(hf, root / f"a{i}", target_modules=targets, r=4, seed=i)
    return root


def _logits(root, mesh=None, quantization=None):
    model = Qwen3ForCausalLM.from_pretrained(root / "base", mesh=mesh, quantization=quantization)
    model.enable_lora(2, 8)
    for i in range(len(TARGETS)):
        adapter = load_adapter(root / f"a{i}", model.config, max_rank=8)
        write_slot(model, i, pack_adapter(adapter, model.config, rank=8))
    return np.asarray(jax.jit(lambda m: m(IDS, lora_slots=SLOTS))(model))


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_tp2_ep4_mixed_adapters_equal_one_device(checkpoint, quantization):
    mesh = make_mesh(2, 4)
    model = Qwen3ForCausalLM.from_pretrained(checkpoint / "base", mesh=mesh)
    model.enable_lora(2, 8)
    spec = model.segments[0].mlp.lora_experts_gate_up_b[...].sharding.spec
    assert spec[2] == "expert" and spec[5] == "model"  # [X, S, E, 2R, 2, F]
    one = _logits(checkpoint, quantization=quantization)
    sharded = _logits(checkpoint, mesh, quantization)
    base = _logits_without_lora(checkpoint, quantization)
    assert np.abs(one[[0, 2]] - base[[0, 2]]).max() > 1e-2  # the adapters act
    np.testing.assert_allclose(sharded, one, atol=2e-5, rtol=0)


def _logits_without_lora(root, quantization):
    model = Qwen3ForCausalLM.from_pretrained(root / "base", quantization=quantization)
    return np.asarray(jax.jit(lambda m: m(IDS))(model))
