"""HF safetensors loading: sharded files, fused expert tensors, errors, bf16, dummy, lazy reads."""

import json
import mmap
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from qwen_jax import Qwen3ForCausalLM
from qwen_jax.config import ModelConfig
from qwen_jax.params import abstract_model
from qwen_jax.safetensors_io import CheckpointReader, SafetensorsFile
from tests.helpers.hf import hf_logits, save_hf_model
from tests.model.conftest import CHECKPOINT, PROMPT, logits


def _copy_config(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def _write_single(directory, tensors):
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _param_shapes(model):
    return jax.tree.map(lambda x: (x.shape, x.dtype), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_reference_load_matches_hf(hf_checkpoint, reference_logits):
    np.testing.assert_allclose(reference_logits, hf_logits(hf_checkpoint[1], PROMPT), atol=1e-4,
                               rtol=0)


def test_sharded_checkpoint_loads_identically(tmp_path, hf_checkpoint, reference_logits):
    src, _ = hf_checkpoint
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    out = _copy_config(src, tmp_path / "sharded")
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / fname))
    weight_map = {k: fname for fname, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    assert CheckpointReader(out)._file_of == {k: out / f for k, f in weight_map.items()}
    np.testing.assert_array_equal(logits(Qwen3ForCausalLM.from_pretrained(out)), reference_logits)


def test_transformers5_fused_expert_tensors_load_identically(tmp_path, hf_checkpoint,
                                                              reference_logits):
    from safetensors.torch import save_file as torch_save_file
    src, hf_model = hf_checkpoint
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    e, f, d = 4, CHECKPOINT["moe_intermediate_size"], 32
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (e, 2 * f, d)
    assert state["model.layers.0.mlp.experts.down_proj"].shape == (e, d, f)
    out = _copy_config(src, tmp_path / "fused")
    torch_save_file(state, str(out / "model.safetensors"))
    assert not any(".experts.0." in k for k in CheckpointReader(out).keys())
    np.testing.assert_array_equal(logits(Qwen3ForCausalLM.from_pretrained(out)), reference_logits)


@pytest.mark.parametrize("name", [
    "model.layers.2.self_attn.k_norm.weight",
    "model.layers.0.mlp.experts.3.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "lm_head.weight",
])
def test_missing_tensor_raises_naming_it(tmp_path, hf_checkpoint, name):
    src, _ = hf_checkpoint
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[name]
    out = _write_single(_copy_config(src, tmp_path / "missing"), tensors)
    with pytest.raises(ValueError, match=re.escape(f"missing tensor '{name}'")):
        Qwen3ForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("name, bad_shape, expected", [
    ("model.layers.0.self_attn.q_proj.weight", (32, 24), (32, 32)),
    ("model.layers.2.mlp.experts.1.down_proj.weight", (32, 16), (32, 12)),
    ("model.embed_tokens.weight", (95, 32), (96, 32)),
])
def test_misshaped_tensor_raises_naming_it_and_shapes(tmp_path, hf_checkpoint, name, bad_shape,
                                                      expected):
    src, _ = hf_checkpoint
    tensors = load_file(str(src / "model.safetensors"))
    tensors[name] = np.zeros(bad_shape, np.float32)
    out = _write_single(_copy_config(src, tmp_path / "misshaped"), tensors)
    with pytest.raises(ValueError) as excinfo:
        Qwen3ForCausalLM.from_pretrained(out)
    message = str(excinfo.value)
    assert name in message
    assert str(list(bad_shape)) in message and str(list(expected)) in message


def test_bf16_checkpoint_loads_as_bf16(tmp_path):
    import torch
    hf_model = save_hf_model(tmp_path, dtype=torch.bfloat16, **CHECKPOINT)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype="bfloat16")
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    # Loaded values are the checkpoint's bf16 bits, transposed where torch stores [out, in].
    hf_state = hf_model.state_dict()
    embed = hf_state["model.embed_tokens.weight"].view(torch.int16).numpy()
    np.testing.assert_array_equal(np.asarray(model.embed_tokens[...]).view(np.int16), embed)
    q0 = hf_state["model.layers.0.self_attn.q_proj.weight"].view(torch.int16).numpy().T
    q_ours = np.asarray(model.segments[0].self_attn.q_proj.kernel[...][0]).view(np.int16)
    np.testing.assert_array_equal(q_ours, q0)
    ours = logits(model)
    assert ours.dtype == np.float32 and np.all(np.isfinite(ours))
    ref = hf_logits(hf_model.float(), PROMPT)
    np.testing.assert_allclose(ours, ref, atol=0.02, rtol=0)  # logits std ~0.1


def test_dummy_init_builds_params_of_right_shapes_and_dtype(hf_checkpoint):
    src, _ = hf_checkpoint
    model = Qwen3ForCausalLM.from_pretrained(src, dtype="bfloat16", load_format="dummy")
    expected = _param_shapes(abstract_model(ModelConfig.from_hf(src), "bfloat16",
                                            model_cls=Qwen3ForCausalLM))
    assert _param_shapes(model) == expected
    assert {dt for _, dt in jax.tree.leaves(expected, is_leaf=lambda x: isinstance(x, tuple))} \
        == {jnp.dtype(jnp.bfloat16)}
    # Random draws, not the checkpoint's weights and not constants.
    embed = np.asarray(model.embed_tokens[...], np.float32)
    assert np.std(embed) > 0.01
    checkpoint_embed = load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"]
    assert not np.allclose(embed, checkpoint_embed, atol=0.01)


def test_preset_name_builds_dummy_model_without_allocating():
    model = nnx.eval_shape(
        lambda: Qwen3ForCausalLM.from_pretrained("qwen3-0.6b", dtype="bfloat16"))
    cfg = ModelConfig.from_hf("qwen3-0.6b")
    assert model.config == cfg
    expected = abstract_model(cfg, "bfloat16", model_cls=Qwen3ForCausalLM)
    assert _param_shapes(model) == _param_shapes(expected)
    assert model.lm_head is None  # tied embeddings


def test_lazy_reader_returns_memmap_views(hf_checkpoint):
    src, _ = hf_checkpoint
    path = src / "model.safetensors"
    file = SafetensorsFile(path)
    assert file._mmap is None  # opening reads the header only
    name = "model.layers.0.self_attn.q_proj.weight"
    array = file.get(name)
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, mmap.mmap), f"tensor is backed by {type(base)}, not the file"
    assert not array.flags.owndata and not array.flags.writeable
    assert array.nbytes == 32 * 32 * 4 < path.stat().st_size
    np.testing.assert_array_equal(array, load_file(str(path))[name])


def test_lazy_reader_reads_bf16(tmp_path):
    import torch
    from safetensors.torch import save_file as torch_save_file
    values = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    torch_save_file({"w": values}, str(tmp_path / "model.safetensors"))
    read = CheckpointReader(tmp_path).get("w", (3, 5))
    assert read.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(read.view(np.int16), values.view(torch.int16).numpy())
