"""Quantised checkpoints loaded straight into their shards on 8 simulated CPU devices: the
stored values, scales and zero points equal the single-device load bit for bit, the scales
follow their weight's split, and the sharded forward gives the single-device logits."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from qwen_jax import Qwen3ForCausalLM
from qwen_jax.sharding import make_mesh
from scripts.quantize_checkpoint import quantise
from tests.helpers.hf import save_hf_model

# Every dim a TP=2 split cuts holds whole 32-blocks: q/o 128 (64 per device), k/v 64,
# expert F 64, dense F 128.
SHAPES = dict(moe=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, num_hidden_layers=3, mlp_only_layers=[1], num_experts=8,
              moe_intermediate_size=64, intermediate_size=128, vocab_size=96, seed=3)
TP2_EP4 = (2, 4)  # both splits at once: heads and F over model, experts over expert
PROMPT = np.random.default_rng(0).integers(2, 96, (2, 9)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    source = tmp_path_factory.mktemp("float")
    save_hf_model(source, **SHAPES)
    out = {"int8": (source, "int8")}
    for fmt in ("fp8", "awq"):
        out[fmt] = (tmp_path_factory.mktemp(fmt), None)
        quantise(source, out[fmt][0], fmt, block=(32, 32), group=32)
    return out


@pytest.fixture(scope="module")
def single_device(checkpoints):
    return {fmt: Qwen3ForCausalLM.from_pretrained(path, quantization=quantization)
            for fmt, (path, quantization) in checkpoints.items()}


def _flat(model):
    return {path: var.get_value() for path, var in
            nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("fmt", ["fp8", "awq", "int8"])
def test_sharded_load_equals_single_device(checkpoints, single_device, fmt):
    path, quantization = checkpoints[fmt]
    single = single_device[fmt]
    sharded = Qwen3ForCausalLM.from_pretrained(path, quantization=quantization,
                                               mesh=make_mesh(*TP2_EP4))
    ours, theirs = _flat(single), _flat(sharded)
    assert ours.keys() == theirs.keys()
    assert any(k[-1].endswith("_scale") for k in ours)
    for key, value in ours.items():
        np.testing.assert_array_equal(np.asarray(theirs[key]).view(np.uint8),
                                      np.asarray(value).view(np.uint8), err_msg=str(key))
    np.testing.assert_allclose(np.asarray(sharded(jnp.asarray(PROMPT))),
                               np.asarray(single(jnp.asarray(PROMPT))), atol=1e-4, rtol=0)


def test_scales_follow_their_weights_split(checkpoints):
    model = Qwen3ForCausalLM.from_pretrained(checkpoints["awq"][0], mesh=make_mesh(*TP2_EP4))
    spec = lambda x: x[...].sharding.spec
    moe, dense = model.segments[2].mlp, model.segments[1].mlp
    # experts: E over expert, F over model, for the int4 values, scales and zero points
    assert spec(moe.down_proj) == spec(moe.down_proj_scale) == spec(moe.down_proj_zero) \
        == P(None, "expert", "model", None)
    assert spec(moe.gate_up_proj_scale) == P(None, "expert", None, None, "model")
    assert spec(dense.down_proj.kernel_scale) == P(None, "model", None)  # row-parallel
    int8 = Qwen3ForCausalLM.from_pretrained(checkpoints["int8"][0], quantization="int8",
                                            mesh=make_mesh(2, 1))
    # per-channel scales over a split K: one row, replicated over the split
    assert int8.segments[1].mlp.down_proj.kernel_scale[...].shape[1] == 1
    assert spec(int8.segments[1].mlp.down_proj.kernel_scale) == P(None, None, None)


def test_dummy_quantized_weights_are_generated_in_their_shards(checkpoints):
    model = Qwen3ForCausalLM.from_pretrained(checkpoints["int8"][0], load_format="dummy",
                                             quantization="int8", mesh=make_mesh(*TP2_EP4))
    gate_up = model.segments[2].mlp.gate_up_proj[...]                   # [X, E, D, 2, F]
    assert gate_up.dtype == jnp.int8 and gate_up.shape == (1, 8, 128, 2, 64)
    assert gate_up.sharding.spec == P(None, "expert", None, None, "model")
    shard = gate_up.addressable_shards[0].data
    assert shard.shape == (1, 2, 128, 2, 32) and len(np.unique(np.asarray(shard))) > 50
