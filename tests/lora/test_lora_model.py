"""The model with LoRA slots against HF transformers + peft: logits within 1e-4 for
adapters on attention only, on the experts only and on both (MoE) and on a dense model;
a batch mixing three adapters and no adapter gives each sequence what it gets alone, on
every expert path of the reference and with the kernels (interpreted)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import pallas_kernels
from qwen_jax import Qwen3ForCausalLM, moe
from qwen_jax.lora import load_adapter
from qwen_jax.lora_layers import write_slot
from qwen_jax.lora_packing import pack_adapter
from tests.helpers.hf import hf_logits, save_hf_model
from tests.helpers.lora import save_peft_adapter

DIMS = dict(head_dim=12, moe_intermediate_size=20, intermediate_size=36)
MOE = dict(moe=True, num_hidden_layers=3, mlp_only_layers=[1], **DIMS)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TARGETS = {"attention": ATTN, "experts": MLP, "both": "all-linear"}  # all: the router too
IDS = np.random.default_rng(0).integers(2, 96, size=(4, 13)).astype(np.int32)
RANK = 16


@nnx.jit
def _logits(model, ids, slots):
    return model(ids, lora_slots=slots)


def logits(model, slots) -> np.ndarray:
    return np.asarray(_logits(model, jnp.asarray(IDS), jnp.asarray(slots, jnp.int32)))


def peft_logits(peft_model) -> np.ndarray:
    with torch.no_grad():
        return peft_model(torch.as_tensor(IDS)).logits.float().numpy()


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    """(checkpoint dir, HF model, {kind: (adapter dir, peft model)})."""
    root = tmp_path_factory.mktemp("lora_moe")
    hf = save_hf_model(root / "base", **MOE)
    adapters = {}
    for seed, (kind, targets) in enumerate(TARGETS.items()):
        directory = root / kind
        adapters[kind] = (directory, save_peft_adapter(hf, directory, target_modules=targets,
                                                       r=4 + 2 * seed, seed=seed))
    return root / "base", hf, adapters


def lora_model(checkpoint, adapter_dirs, impl="reference"):
    """Our model with adapter i in slot i + 1."""
    model = Qwen3ForCausalLM.from_pretrained(checkpoint, impl=impl)
    model.enable_lora(max(3, len(adapter_dirs)), RANK)
    for index, directory in enumerate(adapter_dirs):
        adapter = load_adapter(directory, model.config, max_rank=RANK)
        write_slot(model, index, pack_adapter(adapter, model.config, rank=RANK))
    return model


@pytest.mark.parametrize("kind", list(TARGETS))
def test_one_adapter_matches_peft(moe_setup, kind):
    checkpoint, _, adapters = moe_setup
    directory, peft_model = adapters[kind]
    model = lora_model(checkpoint, [directory])
    np.testing.assert_allclose(logits(model, [1] * 4), peft_logits(peft_model), atol=1e-4,
                               rtol=0)


def _check_mixed(model, hf, adapters):
    kinds = list(TARGETS)
    slots = [1, 0, 3, 2]   # attention, none, both, experts
    got = logits(model, slots)
    for row, slot in enumerate(slots):
        want = (hf_logits(hf, IDS) if slot == 0
                else peft_logits(adapters[kinds[slot - 1]][1]))[row]
        np.testing.assert_allclose(got[row], want, atol=1e-4, rtol=0, err_msg=f"slot {slot}")


def test_mixed_batch_gives_each_sequence_its_own_adapter(moe_setup):
    checkpoint, hf, adapters = moe_setup
    model = lora_model(checkpoint, [adapters[k][0] for k in TARGETS])
    _check_mixed(model, hf, adapters)


@pytest.mark.parametrize("path", ["blocked", "sorted"])
def test_mixed_batch_on_the_other_expert_paths(moe_setup, monkeypatch, path):
    # The reference MoE gathers per pair at this size; force the blocked and sorted paths.
    if path == "blocked":
        monkeypatch.setattr(moe, "block_rows", lambda num_pairs, num_experts: 4)
    else:
        monkeypatch.setattr(moe, "GATHER_LIMIT_BYTES", 0)
    checkpoint, hf, adapters = moe_setup
    model = lora_model(checkpoint, [adapters[k][0] for k in TARGETS])
    _check_mixed(model, hf, adapters)


def test_mixed_batch_with_the_kernels_interpreted(tmp_path, monkeypatch):
    # The Triton kernels' tiles: head dim 16, expert and dense F multiples of 16.
    hf = save_hf_model(tmp_path / "base", moe=True, num_hidden_layers=2, mlp_only_layers=[0],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       moe_intermediate_size=16, intermediate_size=32)
    dirs = []
    for seed, targets in enumerate(TARGETS.values()):
        save_peft_adapter(hf, tmp_path / f"a{seed}", target_modules=targets, r=4, seed=seed)
        dirs.append(tmp_path / f"a{seed}")
    slots = [1, 0, 3, 2]
    want = logits(lora_model(tmp_path / "base", dirs), slots)
    real = pallas_kernels.ops
    monkeypatch.setattr(pallas_kernels, "ops",
                        lambda impl=None: pallas_kernels.interpreted(real(impl)))
    model = lora_model(tmp_path / "base", dirs, impl="pallas")
    assert model.impl == "pallas"
    np.testing.assert_allclose(logits(model, slots), want, atol=1e-4, rtol=0)


def test_dense_model_all_linear_matches_peft(tmp_path):
    hf = save_hf_model(tmp_path / "base", moe=False, **DIMS)
    peft_model = save_peft_adapter(hf, tmp_path / "adapter", target_modules="all-linear", r=8)
    model = lora_model(tmp_path / "base", [tmp_path / "adapter"])
    got = logits(model, [1, 0, 1, 0])
    want_lora, want_base = peft_logits(peft_model), hf_logits(hf, IDS)
    np.testing.assert_allclose(got[[0, 2]], want_lora[[0, 2]], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got[[1, 3]], want_base[[1, 3]], atol=1e-4, rtol=0)


def test_greedy_tokens_identical_to_peft(moe_setup):
    checkpoint, _, adapters = moe_setup
    directory, peft_model = adapters["both"]
    model = lora_model(checkpoint, [directory])
    prompt = IDS[:1, :6]
    with torch.no_grad():
        want = peft_model.generate(torch.as_tensor(prompt), attention_mask=torch.ones_like(
            torch.as_tensor(prompt)), max_new_tokens=8, do_sample=False).numpy()[0]
    tokens = list(prompt[0])
    for _ in range(8):
        out = np.asarray(_logits(model, jnp.asarray([tokens], jnp.int32),
                                 jnp.asarray([1], jnp.int32)))
        tokens.append(int(out[0, -1].argmax()))
    assert tokens == list(want)
