"""LoRA adapters saved by peft 0.21+ (transformers 5) and by hand in the transformers-4
per-expert layout load to factors whose A @ B is peft's own merged delta, pack into buffers
that reproduce each layer's deltas, and refuse anything they cannot serve by name."""

import shutil

import numpy as np
import pytest
import torch

from qwen_jax.config import ModelConfig
from qwen_jax.lora import LoRAAdapter, load_adapter
from qwen_jax.lora_packing import lora_buffer_shapes, pack_adapter
from tests.helpers.hf import hf_logits, save_hf_model
from tests.helpers.lora import (
    PREFIX,
    adapter_deltas,
    apply_deltas,
    grouped_deltas,
    load_peft_adapter,
    merged_deltas,
    packed_deltas,
    read_adapter,
    save_peft_adapter,
    save_per_expert_adapter,
    write_adapter,
)

# D=32, N*H=48, K*H=24, expert F=20 (2F=40), dense F=36, E=4: no two model dims alike, so a
# transposed or misplaced factor rarely passes on shape (values catch the rest); expert F is
# a multiple of 4 for torch's grouped_mm. Layer 1 is dense (mlp_only_layers).
DIMS = dict(head_dim=12, moe_intermediate_size=20, intermediate_size=36)
MOE = dict(moe=True, num_hidden_layers=3, mlp_only_layers=[1], **DIMS)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TOL = dict(rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(HF model, ModelConfig) of a tiny Qwen3-MoE: segments moe, dense, moe."""
    directory = tmp_path_factory.mktemp("hf_moe")
    return save_hf_model(directory, **MOE), ModelConfig.from_hf(directory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_dense")
    return save_hf_model(directory, moe=False, **DIMS), ModelConfig.from_hf(directory)


@pytest.fixture(scope="module")
def base_adapter(moe, tmp_path_factory):
    """A peft adapter on attention and (fused) experts, r=4, the error cases' starting point."""
    directory = tmp_path_factory.mktemp("adapter")
    save_peft_adapter(moe[0], directory, target_modules=ATTN + MLP)
    return directory


def assert_matches(adapter: LoRAAdapter, deltas, cfg: ModelConfig) -> None:
    """Every module's A @ B is the reference delta; packed buffers (tight and padded rank)
    have the shapes of lora_buffer_shapes and reproduce each layer's grouped deltas."""
    got = adapter_deltas(adapter)
    assert set(got) == set(deltas)
    for key, delta in deltas.items():
        np.testing.assert_allclose(got[key], delta, **TOL, err_msg=str(key))
    want = grouped_deltas(cfg, deltas)
    for rank in (adapter.rank, 16):
        packed = pack_adapter(adapter, cfg, rank=rank)
        shapes = lora_buffer_shapes(cfg, rank)
        assert [{k: v.shape for k, v in seg.items()} for seg in packed] == shapes
        have = packed_deltas(cfg, packed)
        for key in want:
            np.testing.assert_allclose(have[key], want[key], **TOL, err_msg=f"{key} R={rank}")


PEFT_CASES = {
    "attention": dict(target_modules=ATTN),
    "experts_fused": dict(target_modules=MLP),
    "attention_and_experts": dict(target_modules=ATTN + MLP),
    "patterns": dict(target_modules=ATTN + MLP, rank_pattern={"q_proj": 2},
                     alpha_pattern={r"layers\.2\.self_attn\.v_proj": 3}),
    "rslora": dict(target_modules=ATTN + MLP, use_rslora=True, alpha=6),
    "gate_up_param_only": dict(target_modules=[], target_parameters=["gate_up_proj"]),
    "down_param_only": dict(target_modules=[], target_parameters=["down_proj"]),
    "some_layers": dict(target_modules=["v_proj", "o_proj"], layers_to_transform=[2]),
}


@pytest.mark.parametrize("case", PEFT_CASES)
def test_peft_adapter_on_moe_matches_peft_merge(case, moe, tmp_path):
    hf, cfg = moe
    peft_model = save_peft_adapter(hf, tmp_path, **PEFT_CASES[case])
    adapter = load_adapter(tmp_path, cfg, max_rank=4)
    assert_matches(adapter, merged_deltas(peft_model, hf), cfg)
    assert adapter.rank == (2 if case == "gate_up_param_only" else 4)  # unfused: rank 4 = 2 x 2
    assert adapter.name == tmp_path.name


def test_experts_become_fused_and_dense_layers_load_what_peft_saved(moe, tmp_path):
    """peft turns MLP targets into the fused expert parameters of the MoE layers; the dense
    layer (1) keeps its MLP LoRA on peft 0.22+ and has none on 0.21: either way the loader
    takes exactly the modules the file holds."""
    hf, cfg = moe
    save_peft_adapter(hf, tmp_path, target_modules=MLP)
    tensors, config = read_adapter(tmp_path)
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]
    dense = sorted({(1, f"mlp.{p}") for p in MLP
                    if f"{PREFIX}model.layers.1.mlp.{p}.lora_A.weight" in tensors})
    assert dense in ([], [(1, f"mlp.{p}") for p in sorted(MLP)])
    adapter = load_adapter(tmp_path, cfg, max_rank=4)  # gate_up_proj has rank 8 = 2 * max_rank
    assert sorted(adapter.modules) == sorted(
        [(layer, f"mlp.experts.{p}") for layer in (0, 2)
         for p in ("down_proj", "gate_up_proj")] + dense)
    a, b = adapter.modules[(0, "mlp.experts.gate_up_proj")]
    assert a.shape == (4, 32, 8) and b.shape == (4, 8, 40)
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.modules.values()) > 0


def test_dense_model_all_linear_matches_peft_merge(dense, tmp_path):
    hf, cfg = dense
    peft_model = save_peft_adapter(hf, tmp_path, target_modules="all-linear", r=3, alpha=5)
    adapter = load_adapter(tmp_path, cfg, max_rank=3)
    deltas = merged_deltas(peft_model, hf)
    assert len(deltas) == 2 * 7
    assert_matches(adapter, deltas, cfg)


def test_forward_with_loaded_deltas_matches_peft_logits(moe, tmp_path):
    hf, cfg = moe
    peft_model = save_peft_adapter(hf, tmp_path, target_modules=ATTN + MLP, seed=3)
    adapter = load_adapter(tmp_path, cfg, max_rank=4)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        want = peft_model(torch.as_tensor(tokens)).logits.numpy()
    got = hf_logits(apply_deltas(hf, adapter_deltas(adapter)), tokens)
    assert np.abs(want - hf_logits(hf, tokens)).max() > 1e-2  # the adapter changes the output
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_per_expert_layout_matches_intended_and_peft(moe, tmp_path):
    hf, cfg = moe
    deltas = save_per_expert_adapter(tmp_path, cfg, attention=("q_proj",))
    adapter = load_adapter(tmp_path, cfg, max_rank=4)
    assert_matches(adapter, deltas, cfg)
    # peft converts this layout to the fused one on load (and drops dense-layer MLP LoRA).
    ours = grouped_deltas(cfg, deltas)
    theirs = grouped_deltas(cfg, merged_deltas(load_peft_adapter(hf, tmp_path), hf))
    for key in [(0, "gate_up"), (0, "down"), (2, "gate_up"), (2, "down"), (1, "qkv")]:
        np.testing.assert_allclose(ours[key], theirs[key], **TOL, err_msg=str(key))


@pytest.mark.parametrize("rslora", [False, True])
def test_per_expert_ranks_differ_per_expert(rslora, moe, tmp_path):
    cfg = moe[1]
    patterns = dict(rank_pattern={r"experts\.1\.gate_proj": 2, "experts.3.down_proj": 6},
                    alpha_pattern={"up_proj": 5})
    deltas = save_per_expert_adapter(tmp_path, cfg, use_rslora=rslora, **patterns)
    adapter = load_adapter(tmp_path, cfg, max_rank=6)
    assert adapter.rank == 6 and adapter.modules[(0, "mlp.experts.down_proj")][0].shape[-1] == 6
    assert_matches(adapter, deltas, cfg)


def test_all_linear_with_the_router_matches_peft(moe, tmp_path):
    # peft saves all-linear resolved, the router (mlp.gate.weight) included; as a
    # transformers-4 config ("all-linear", router module "gate") it loads the same.
    hf, cfg = moe
    peft_model = save_peft_adapter(hf, tmp_path, target_modules="all-linear")
    tensors, config = read_adapter(tmp_path)
    assert "gate.weight" in config["target_parameters"]
    deltas = merged_deltas(peft_model, hf)
    assert (0, "mlp.gate") in deltas
    assert_matches(load_adapter(tmp_path, cfg, max_rank=4), deltas, cfg)
    config.update(target_modules="all-linear", target_parameters=None, rank_pattern={},
                  alpha_pattern={})
    write_adapter(tmp_path, tensors, config)
    assert_matches(load_adapter(tmp_path, cfg, max_rank=4), deltas, cfg)


def test_lora_buffer_shapes_per_segment(moe):
    cfg = moe[1]
    moe_seg = {"self_attn.lora_qkv_a": (1, 32, 24), "self_attn.lora_qkv_b": (1, 24, 96),
               "self_attn.lora_o_a": (1, 48, 8), "self_attn.lora_o_b": (1, 8, 32),
               "mlp.lora_gate_up_a": (1, 4, 32, 16), "mlp.lora_gate_up_b": (1, 4, 16, 2, 20),
               "mlp.lora_down_a": (1, 4, 20, 8), "mlp.lora_down_b": (1, 4, 8, 32),
               "mlp.lora_router_a": (1, 32, 8), "mlp.lora_router_b": (1, 8, 4)}
    dense_seg = {**{k: v for k, v in moe_seg.items() if k.startswith("self_attn")},
                 "mlp.lora_gate_up_a": (1, 32, 16), "mlp.lora_gate_up_b": (1, 16, 2, 36),
                 "mlp.lora_down_a": (1, 36, 8), "mlp.lora_down_b": (1, 8, 32)}
    assert lora_buffer_shapes(cfg, 8) == [moe_seg, dense_seg, moe_seg]


def test_pack_refuses_a_rank_below_the_adapters(moe, base_adapter):
    adapter = load_adapter(base_adapter, moe[1], max_rank=4)
    with pytest.raises(ValueError, match=r"rank of adapter .* must be <= 3 \(buffer rank 3\)"):
        pack_adapter(adapter, moe[1], rank=3)
    packed = pack_adapter(adapter, moe[1], rank=4, dtype=np.float16)
    assert packed[0]["mlp.lora_gate_up_a"].dtype == np.float16


def test_pack_refuses_another_models_adapter(moe, dense, base_adapter):
    adapter = load_adapter(base_adapter, moe[1], max_rank=4)
    with pytest.raises(ValueError, match="module of layer 0 .a dense layer. must be"):
        pack_adapter(adapter, dense[1], rank=4)


# ---- errors ----------------------------------------------------------------------------
Q_A = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"
FUSED_A = f"{PREFIX}model.layers.0.mlp.experts.base_layer.lora_A.weight"


def _config(**changes):
    return lambda tensors, config: config.update(changes)


def _patterns(**ranks):
    return lambda tensors, config: config["rank_pattern"].update(ranks)


def _add(key, shape):
    return lambda tensors, config: tensors.update({key: np.zeros(shape, np.float32)})


def _reshape_q_a(tensors, config):
    tensors[Q_A] = np.zeros((4, 31), np.float32)


def _drop_q_b(tensors, config):
    del tensors[Q_A.replace("lora_A", "lora_B")]


def _empty(tensors, config):
    tensors.clear()


ERRORS = {
    "peft_type": (_config(peft_type="IA3"), "peft_type must be 'LORA'"),
    "use_dora": (_config(use_dora=True), "use_dora must be false"),
    "lora_bias": (_config(lora_bias=True), "lora_bias must be false"),
    "modules_to_save": (_config(modules_to_save=["lm_head"]), r"modules_to_save must .*lm_head"),
    "bias": (_config(bias="lora_only"), "bias must be 'none'.*'lora_only'"),
    "rank_pattern": (_patterns(q_proj=16),
                     r"rank_pattern\['q_proj'\] \(the rank of model\.layers\.0\.self_attn\.q_proj"
                     r"\) must be <= max_rank=4, got 16"),
    "lm_head": (_config(target_modules=["lm_head"]), "target_modules entry 'lm_head' is the LM"),
    "embed_tokens": (_config(target_modules=["embed_tokens"]),
                     "target_modules entry 'embed_tokens' is the token embedding"),
    "foo_proj": (_config(target_modules=["q_proj", "foo_proj"]),
                 "target_modules entry 'foo_proj' names no module"),
    "regex": (_config(target_modules=r".*\.foo"), r"target_modules must be a regex matching"),
    "bad_regex": (_config(target_modules="(q_proj"), "target_modules must be a valid regular"),
    "bad_pattern": (_patterns(**{"[": 2}), r"rank_pattern key must be a valid regular .*'\['"),
    # peft 0.22+ keeps the MLP names in target_modules (0.21 moved them): drop both.
    "unwrapped_fused": (_config(target_parameters=[], target_modules=ATTN),
                        "in a layer target_parameters wraps .none wraps mlp.experts of layer 0"),
    "foo_param": (_config(target_parameters=["down_proj", "foo"]),
                  "target_parameters entry 'foo' names no parameter"),
    "layers_to_transform": (_config(layers_to_transform=[0, 5]),
                            r"layers_to_transform must be layer indices in \[0, "
                            r"num_hidden_layers=3\), got \[0, 5\]"),
    "lm_head_tensor": (_add(f"{PREFIX}lm_head.lora_A.weight", (4, 32)),
                       "tensor key 'base_model.model.lm_head.lora_A.weight' in "
                       "adapter_model.safetensors maps to no supported module"),
    "embedding_tensor": (_add(f"{PREFIX}model.embed_tokens.lora_embedding_A", (4, 96)),
                         "embed_tokens.lora_embedding_A' in adapter_model.safetensors maps to no"),
    "dense_mlp_in_moe_layer": (_add(f"{PREFIX}model.layers.0.mlp.gate_proj.lora_A.weight", (4, 32)),
                               "maps to no supported module of layer 0 .a moe layer"),
    "nested_too_deep": (_add(FUSED_A.replace("base_layer", "base_layer.base_layer"), (32, 32)),
                        r"at most 1 '\.base_layer'"),
    "expert_index": (_add(f"{PREFIX}model.layers.0.mlp.experts.9.up_proj.lora_A.weight", (4, 32)),
                     "expert index of tensor .* must be < num_experts=4, got 9"),
    "layer_index": (_add(Q_A.replace("layers.0", "layers.7"), (4, 32)),
                    "layer index of tensor .* must be < num_hidden_layers=3, got 7"),
    "shape": (_reshape_q_a, r"shape of tensor '.*q_proj\.lora_A\.weight' must be \[4, 32\] .*, "
                            r"got \[4, 31\]"),
    "no_lora_b": (_drop_q_b, r"q_proj\.lora_A\.weight' needs its lora_B: .* is missing"),
    "no_tensors": (_empty, "adapter_model.safetensors must be at least one lora_A"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_unservable_adapter_is_refused_by_name(case, moe, base_adapter, tmp_path):
    edit, message = ERRORS[case]
    tensors, config = read_adapter(base_adapter)
    edit(tensors, config)
    write_adapter(tmp_path, tensors, config)
    with pytest.raises(ValueError, match=message):
        load_adapter(tmp_path, moe[1], max_rank=4)


def test_mixed_expert_layouts_are_refused(moe, base_adapter, tmp_path):
    tensors, config = read_adapter(base_adapter)
    for part, shape in (("lora_A", (4, 32)), ("lora_B", (20, 4))):
        tensors[f"{PREFIX}model.layers.0.mlp.experts.0.up_proj.{part}.weight"] = np.ones(shape)
    write_adapter(tmp_path, tensors, config)
    with pytest.raises(ValueError, match="expert LoRA layout of layer 0 must be either per expert"):
        load_adapter(tmp_path, moe[1], max_rank=4)


def test_rank_above_max_rank_names_the_module(moe, base_adapter):
    with pytest.raises(ValueError, match=r"^r \(the rank of model\.layers\.0\.mlp\.experts\."
                                         r"down_proj\) must be <= max_rank=3, got 4"):
        load_adapter(base_adapter, moe[1], max_rank=3)
    with pytest.raises(ValueError, match="max_rank must be an integer >= 1, got 0"):
        load_adapter(base_adapter, moe[1], max_rank=0)


def test_fused_gate_up_rank_limit_is_twice_max_rank(moe, tmp_path):
    save_peft_adapter(moe[0], tmp_path, target_modules=[], target_parameters=["gate_up_proj"],
                      r=6)
    assert load_adapter(tmp_path, moe[1], max_rank=3).rank == 3  # rank 6 fused = 3 per half
    with pytest.raises(ValueError, match=r"^r \(the rank of model\.layers\.0\.mlp\.experts\."
                                         r"gate_up_proj\) must be <= 2 \* max_rank = 4"):
        load_adapter(tmp_path, moe[1], max_rank=2)


def test_missing_expert_is_refused(moe, tmp_path):
    save_per_expert_adapter(tmp_path, moe[1], drop=("layers.2.mlp.experts.3.up_proj",))
    with pytest.raises(ValueError, match=r"experts of model\.layers\.2\.mlp\.experts\.<e>\.up_proj"
                                         r" must be all num_experts=4, got '3 with LoRA, "
                                         r"missing \[3\]'"):
        load_adapter(tmp_path, moe[1], max_rank=4)


def test_expert_targets_on_a_dense_model_are_refused(dense, tmp_path):
    save_peft_adapter(dense[0], tmp_path, target_modules=["q_proj"])
    tensors, config = read_adapter(tmp_path)
    write_adapter(tmp_path, tensors, {**config, "target_parameters": ["gate_up_proj"]})
    with pytest.raises(ValueError, match="target_parameters entry 'gate_up_proj' names no param"):
        load_adapter(tmp_path, dense[1], max_rank=4)


def test_missing_files_are_refused(moe, base_adapter, tmp_path):
    cfg = moe[1]
    with pytest.raises(ValueError, match="adapter path must be an existing directory"):
        load_adapter(tmp_path / "nope", cfg, max_rank=4)
    with pytest.raises(ValueError, match="adapter path must be a directory with "
                                         "adapter_config.json"):
        load_adapter(tmp_path, cfg, max_rank=4)
    shutil.copy(base_adapter / "adapter_config.json", tmp_path)
    (tmp_path / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="with adapter_model.safetensors, got .*adapter_model.bin "
                                         "is not supported"):
        load_adapter(tmp_path, cfg, max_rank=4)
