"""ModelConfig.from_hf: both HF spellings, layer kinds, validation, round trip, YaRN vs HF."""

import numpy as np
import pytest

from qwen_jax.config import ModelConfig

TINY_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=32,
                intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rope_theta=10000.0, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def _hf(**overrides) -> dict:
    return {**TINY_MOE, **overrides}


def test_num_experts_and_num_local_experts_spellings_agree():
    v4 = ModelConfig.from_hf(_hf())
    fields = _hf()
    fields["num_local_experts"] = fields.pop("num_experts")
    v5 = ModelConfig.from_hf(fields)
    assert v5 == v4 and v5.num_experts == 4


def test_legacy_rope_scaling_type_and_rope_parameters_agree():
    legacy = ModelConfig.from_hf(_hf(rope_theta=1e6, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}))
    fields = _hf()
    fields.pop("rope_theta")
    v5 = ModelConfig.from_hf({**fields, "rope_parameters": {"rope_theta": 1e6, **YARN}})
    assert legacy == v5
    assert legacy.rope_theta == 1e6 and legacy.rope_scaling["rope_type"] == "yarn"
    np.testing.assert_array_equal(legacy.rope_inv_freq_and_scale[0], v5.rope_inv_freq_and_scale[0])


def test_default_rope_parameters_mean_no_scaling():
    fields = _hf()
    fields.pop("rope_theta")
    cfg = ModelConfig.from_hf({**fields, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 5e5}})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None


@pytest.mark.parametrize("overrides", [
    dict(mlp_only_layers=[0, 2], num_hidden_layers=5),
    dict(decoder_sparse_step=2, num_hidden_layers=4),
    dict(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6),
    dict(num_experts=0, num_hidden_layers=3),
])
def test_layer_kinds_follow_hf_layer_classes(overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    hf = _hf(**overrides)
    cfg = ModelConfig.from_hf(hf)
    hf_model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf))
    expected = tuple("moe" if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) else "dense"
                     for layer in hf_model.model.layers)
    assert cfg.layer_kinds == expected


def test_segments_are_runs_of_same_kind_layers():
    cfg = ModelConfig.from_hf(_hf(mlp_only_layers=[0, 3], num_hidden_layers=6,
                                  decoder_sparse_step=1))
    assert cfg.layer_kinds == ("dense", "moe", "moe", "dense", "moe", "moe")
    assert cfg.segments == (("dense", 0, 1), ("moe", 1, 2), ("dense", 3, 1), ("moe", 4, 2))
    step2 = ModelConfig.from_hf(_hf(decoder_sparse_step=2, num_hidden_layers=4))
    assert step2.segments == (("dense", 0, 1), ("moe", 1, 1), ("dense", 2, 1), ("moe", 3, 1))
    assert ModelConfig.from_hf(_hf()).segments == (("moe", 0, 4),)


def test_head_dim_may_differ_from_hidden_over_heads():
    from qwen_jax.model import Qwen3ForCausalLM
    from qwen_jax.params import abstract_model
    cfg = ModelConfig.from_hf(_hf(head_dim=16))
    assert cfg.head_dim == 16 != cfg.hidden_size // cfg.num_attention_heads
    attn = abstract_model(cfg, model_cls=Qwen3ForCausalLM).segments[0].self_attn
    assert attn.q_proj.kernel.shape == (4, 32, 4 * 16)
    assert attn.k_proj.kernel.shape == (4, 32, 2 * 16)
    assert attn.o_proj.kernel.shape == (4, 4 * 16, 32)
    fields = _hf()
    fields.pop("head_dim")
    assert ModelConfig.from_hf(fields).head_dim == 32 // 4


@pytest.mark.parametrize("overrides, field", [
    (dict(architectures=["LlamaForCausalLM"]), "architectures"),
    (dict(architectures=None, model_type="llama"), "model_type"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_local_experts=8), "num_local_experts"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    (dict(mlp_only_layers=[4]), "mlp_only_layers"),
    (dict(mlp_only_layers=[-1]), "mlp_only_layers"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_inconsistent_fields_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(_hf(**overrides))


@pytest.mark.parametrize("source", [
    "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-0.6b",
    _hf(mlp_only_layers=[1], decoder_sparse_step=2, norm_topk_prob=True,
        tie_word_embeddings=True, attention_bias=True, eos_token_id=[1, 2]),
    _hf(rope_scaling=YARN),
])
def test_to_hf_dict_round_trips(source):
    cfg = ModelConfig.from_hf(source)
    assert ModelConfig.from_hf(cfg.to_hf_dict()) == cfg


def test_to_hf_dict_is_read_identically_by_transformers():
    from transformers import Qwen3MoeConfig
    cfg = ModelConfig.from_hf(_hf(mlp_only_layers=[1], norm_topk_prob=True, rope_scaling=YARN))
    hf_config = Qwen3MoeConfig(**cfg.to_hf_dict())
    assert ModelConfig.from_hf(hf_config.to_dict()) == cfg


@pytest.mark.parametrize("rope", [
    YARN,
    {**YARN, "factor": 8.0, "beta_fast": 16, "beta_slow": 2},
    {**YARN, "attention_factor": 0.8},
    {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7},
    {**YARN, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
])
def test_yarn_matches_transformers_rope_init(rope):
    from transformers import Qwen3MoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    fields = _hf(head_dim=64, max_position_embeddings=131072)
    theta = fields.pop("rope_theta")
    hf_config = Qwen3MoeConfig(**fields, rope_parameters={"rope_theta": theta, **rope})
    ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    cfg = ModelConfig.from_hf(hf_config.to_dict())
    inv_freq, scale = cfg.rope_inv_freq_and_scale
    assert inv_freq.shape == (32,) and inv_freq.dtype == np.float32
    np.testing.assert_allclose(inv_freq, ref_inv_freq.numpy(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(float(ref_scale), rel=1e-7)


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_yarn_without_original_max_positions_defaults_like_transformers(spelling):
    from transformers import Qwen3MoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    fields = _hf(head_dim=64, max_position_embeddings=4096)
    theta = fields.pop("rope_theta")
    rope = {"rope_type": "yarn", "factor": 4.0}
    if spelling == "rope_parameters":
        fields["rope_parameters"] = {"rope_theta": theta, **rope}
    else:
        fields.update(rope_theta=theta, rope_scaling=rope)
    cfg = ModelConfig.from_hf(fields)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](Qwen3MoeConfig(**fields))
    np.testing.assert_allclose(cfg.rope_inv_freq_and_scale[0], ref_inv_freq.numpy(), rtol=1e-6)
    assert cfg.rope_inv_freq_and_scale[1] == pytest.approx(float(ref_scale), rel=1e-7)


def test_yarn_config_built_directly_requires_original_max_positions():
    fields = {k: v for k, v in TINY_MOE.items() if k != "architectures"}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ModelConfig(architecture="Qwen3MoeForCausalLM", **fields,
                    rope_scaling={"rope_type": "yarn", "factor": 2.0})
