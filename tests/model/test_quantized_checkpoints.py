"""Quantised checkpoints made by scripts/quantize_checkpoint.py from the embedded tiny model:
laid out exactly as Qwen's FP8 checkpoints and AutoAWQ's GEMM checkpoints are (checked by
HF transformers' own FP8 loader and by AutoAWQ's packing and unpacking, re-implemented
here), loaded quantised, and close to the float model.

Closeness is measured on the tiny model's chat prompts (two per task): the mean KL
divergence of the next-token distributions and how often the most likely token is the
float model's. Bounds are about 2x what was measured on the shipped model
(`docs/benchmarks.md`, "Quantised weights"): int8 (per-channel, 0.4% of a column's max per
weight) KL 0.013 -> <= 0.03; fp8 (3 mantissa bits: up to 6% of each weight) KL 0.025 ->
<= 0.05; AWQ int4 (16 levels per group of 32: up to 3% of the group's range,
round-to-nearest without AWQ's search) KL 0.068 -> <= 0.15. The model trained with the
tool task is near-certain at most positions, so the same weight error moves its KL ~25x
more than the first tiny model's (int8 was 0.0005); its task accuracy per format stays
>= 0.98 (the same page). The largest single-logit error is not bounded: a tiny
perturbation can flip a near-tied router choice and move one position's logits a lot.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from qwen_jax import Qwen3ForCausalLM
from qwen_jax.config import ModelConfig
from scripts.quantize_checkpoint import quantise
from serving.bench.eval_tasks import TINY_MODEL, prompt_batch

KL_BOUND = {"int8": 0.03, "fp8": 0.05, "awq": 0.15}
TOP1_BOUND = {"int8": 0.97, "fp8": 0.95, "awq": 0.9}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"fp8": Qwen-style 128x128 blocks, "awq": AutoAWQ with group_size 32}."""
    root = tmp_path_factory.mktemp("quantised")
    out = {}
    for fmt, options in (("fp8", dict(block=(128, 128), group=128)),
                         ("awq", dict(block=(128, 128), group=32))):
        out[fmt] = root / fmt
        quantise(TINY_MODEL, out[fmt], fmt, **options)
    return out


@pytest.fixture(scope="module")
def prompts():
    return prompt_batch(2)


@pytest.fixture(scope="module")
def float_logits(prompts):
    return np.asarray(Qwen3ForCausalLM.from_pretrained(TINY_MODEL)(jnp.asarray(prompts[0])))


def load_file(path: str) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file, read by safetensors' torch loader (numpy's cannot
    return fp8); fp8 and bf16 come back as ml_dtypes arrays."""
    import torch
    from safetensors.torch import load_file as torch_load
    special = {torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
               torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
    out = {}
    for name, tensor in torch_load(path).items():
        if tensor.dtype in special:
            view, dtype = special[tensor.dtype]
            out[name] = tensor.view(view).numpy().view(dtype)
        else:
            out[name] = tensor.numpy()
    return out


def _closeness(model, prompts, reference):
    batch, mask = prompts
    ours = jax.nn.log_softmax(np.asarray(model(jnp.asarray(batch)))[mask])
    theirs = jax.nn.log_softmax(reference[mask])
    kl = float(np.mean(np.sum(np.exp(theirs) * (theirs - ours), axis=-1)))
    return kl, float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))


# ---- the layouts ---------------------------------------------------------------------------
def test_fp8_checkpoint_is_laid_out_as_qwens(checkpoints):
    config = json.loads((checkpoints["fp8"] / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in config.items() if k != "modules_to_not_convert"} == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]}
    assert config["modules_to_not_convert"][:4] == [
        "lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate",
        "model.layers.0.post_attention_layernorm"]
    stored = load_file(str(checkpoints["fp8"] / "model.safetensors"))
    original = load_file(str(TINY_MODEL / "model.safetensors"))
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.experts.3.down_proj",
                 "model.layers.2.mlp.up_proj"):
        weight, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"]
        out, inp = original[f"{name}.weight"].shape
        assert weight.dtype == ml_dtypes.float8_e4m3fn and weight.shape == (out, inp)
        assert scale.dtype == np.float32 and scale.shape == (-(-out // 128), -(-inp // 128))
        blocks = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:out, :inp]
        dequantised = weight.astype(np.float32) * blocks  # weight_scale_inv multiplies
        np.testing.assert_allclose(dequantised, original[f"{name}.weight"], rtol=2.0 ** -4,
                                   atol=float(scale.max()) * 2.0 ** -9)
    for name in ("model.layers.0.mlp.gate.weight", "model.norm.weight", "lm_head.weight"):
        np.testing.assert_array_equal(stored[name], original[name])


def _autoawq_pack(intweight):
    """AutoAWQ WQLinear_GEMM.from_linear's loop: [in, out] ints -> int32 [in, out / 8]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = np.zeros((intweight.shape[0], intweight.shape[1] // 8), np.int64)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + order_map[i]].astype(np.int64) << (i * 4)
    return packed.astype(np.uint32).view(np.int32)


def _autoawq_unpack(packed):
    """AutoAWQ packing_utils.unpack_awq + reverse_awq_order: nibbles in shift order, then
    columns put back from AWQ's order -> [rows, 8 * cols]."""
    shifts = np.arange(0, 32, 4)
    nibbles = ((packed.astype(np.int64)[:, :, None] >> shifts) & 15).reshape(packed.shape[0], -1)
    reverse = np.arange(nibbles.shape[1]).reshape(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]]
    return nibbles[:, reverse.ravel()]


def test_awq_checkpoint_is_packed_as_autoawq(checkpoints):
    config = json.loads((checkpoints["awq"] / "config.json").read_text())["quantization_config"]
    assert config == {"bits": 4, "group_size": 32, "modules_to_not_convert": [
        "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.3.mlp.gate"],
        "quant_method": "awq", "version": "gemm", "zero_point": True}
    stored = load_file(str(checkpoints["awq"] / "model.safetensors"))
    original = load_file(str(TINY_MODEL / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.experts.5.down_proj"):
        w = original[f"{name}.weight"].T                                    # [in, out]
        qweight, qzeros, scales = (stored[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales"))
        assert f"{name}.weight" not in stored
        assert qweight.dtype == np.int32 and qweight.shape == (w.shape[0], w.shape[1] // 8)
        assert qzeros.dtype == np.int32 and qzeros.shape == (w.shape[0] // 32, w.shape[1] // 8)
        assert scales.dtype == np.float16 and scales.shape == (w.shape[0] // 32, w.shape[1])
        # AutoAWQ's from_linear packing of the unpacked values gives the stored bits back.
        np.testing.assert_array_equal(_autoawq_pack(_autoawq_unpack(qweight)), qweight)
        np.testing.assert_array_equal(_autoawq_pack(_autoawq_unpack(qzeros)), qzeros)
        # dequantize_gemm: (q - zero) * scale, within half a step of the float weight.
        step = np.repeat(scales.astype(np.float32), 32, 0)
        dequantised = (_autoawq_unpack(qweight) - np.repeat(_autoawq_unpack(qzeros), 32, 0)) \
            * step
        assert np.all(np.abs(dequantised - w) <= 0.51 * step + 1e-6)


def test_hf_transformers_reads_our_fp8_checkpoint_as_we_do(checkpoints, prompts):
    """transformers' FineGrainedFP8 loader (dequantize=True runs on CPU) gives our logits."""
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    hf = AutoModelForCausalLM.from_pretrained(
        checkpoints["fp8"], dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(dequantize=True))
    batch = prompts[0][:2, :40]
    with torch.no_grad():
        theirs = hf(torch.tensor(batch)).logits.numpy()
    ours = np.asarray(Qwen3ForCausalLM.from_pretrained(checkpoints["fp8"])(jnp.asarray(batch)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


# ---- loading ---------------------------------------------------------------------------------
def _kinds(model):
    return {str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("fmt", ["fp8", "awq", "int8"])
def test_quantised_model_is_close_to_the_float_model(fmt, checkpoints, prompts, float_logits):
    if fmt == "int8":
        model = Qwen3ForCausalLM.from_pretrained(TINY_MODEL, quantization="int8")
    else:
        model = Qwen3ForCausalLM.from_pretrained(checkpoints[fmt])
    stored = {"fp8": "float8_e4m3fn", "awq": "uint8", "int8": "int8"}[fmt]
    assert stored in _kinds(model)
    kl, top1 = _closeness(model, prompts, float_logits)
    assert kl <= KL_BOUND[fmt] and top1 >= TOP1_BOUND[fmt], (kl, top1)


def test_online_fp8_equals_the_fp8_checkpoint(checkpoints):
    """Quantising at load and reading the script's checkpoint give the same stored bits:
    the loader reads weight / weight_scale_inv into our layout exactly."""
    online = nnx.to_flat_state(nnx.state(
        Qwen3ForCausalLM.from_pretrained(TINY_MODEL, quantization="fp8"), nnx.Param))
    read = dict(nnx.to_flat_state(nnx.state(
        Qwen3ForCausalLM.from_pretrained(checkpoints["fp8"]), nnx.Param)))
    assert len(online) == len(read) > 0
    for path, var in online:
        a, b = np.asarray(var.get_value()), np.asarray(read[path].get_value())
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=str(path))


def test_router_norms_embeddings_and_lm_head_stay_float(checkpoints):
    model = Qwen3ForCausalLM.from_pretrained(checkpoints["fp8"])
    layer = model.segments[0]
    assert model.embed_tokens[...].dtype == model.lm_head[...].dtype == jnp.float32
    assert layer.mlp.gate[...].dtype == layer.input_layernorm.weight[...].dtype == jnp.float32
    assert layer.self_attn.q_proj.kernel[...].dtype == jnp.float8_e4m3fn
    assert layer.mlp.gate_up_proj[...].dtype == jnp.float8_e4m3fn


def test_a_module_left_float_in_one_layer_keeps_its_stack_float(tmp_path, checkpoints,
                                                                 prompts, float_logits):
    """modules_to_not_convert naming one layer's q_proj: that scanned stack stays float (the
    quantised layers dequantised at load), the rest stays fp8."""
    quantise(TINY_MODEL, tmp_path, "fp8", block=(128, 128), group=128)
    stored = load_file(str(tmp_path / "model.safetensors"))
    stored["model.layers.1.self_attn.q_proj.weight"] = load_file(
        str(TINY_MODEL / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    del stored["model.layers.1.self_attn.q_proj.weight_scale_inv"]
    from safetensors.numpy import save_file
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(
        "model.layers.1.self_attn.q_proj")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert model.segments[0].self_attn.q_proj.kernel[...].dtype == jnp.float32  # layers 0-1
    assert model.segments[0].self_attn.k_proj.kernel[...].dtype == jnp.float8_e4m3fn
    assert model.segments[2].self_attn.q_proj.kernel[...].dtype == jnp.float8_e4m3fn
    kl, _ = _closeness(model, prompts, float_logits)
    assert kl <= KL_BOUND["fp8"]


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("config,match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method is 'gptq' \\(GPTQ\\)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "mystery"}, "quant_method is 'mystery'.*supported: fp8"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size.*per-tensor"),
    ({"quant_method": "awq", "bits": 8}, "bits must be 4"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version must be 'gemm'"),
])
def test_unsupported_quantization_config_is_refused_naming_it(tmp_path, config, match):
    hf = json.loads((TINY_MODEL / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**hf, "quantization_config": config})


def test_quantization_option_must_match_the_checkpoint(checkpoints):
    with pytest.raises(ValueError, match="quantization must be 'fp8'.*quant_method"):
        Qwen3ForCausalLM.from_pretrained(checkpoints["fp8"], quantization="awq")
    with pytest.raises(ValueError, match="an AWQ checkpoint"):
        Qwen3ForCausalLM.from_pretrained(TINY_MODEL, quantization="awq")


def test_tensor_parallel_split_inside_a_block_is_refused_naming_it(checkpoints):
    from qwen_jax.sharding import make_mesh
    with pytest.raises(ValueError, match=r"cannot split quantised weight model\.layers\.\d+-\d+"
                                         r"\.\S+: tensor_parallel_size=2 cuts its \w+ dim of "
                                         r"\d+ into \d+-wide shards, not a multiple of the fp8 "
                                         r"scale block of 128"):
        Qwen3ForCausalLM.from_pretrained(checkpoints["fp8"], mesh=make_mesh(2, 1))


def test_convert_keeps_quantised_weights_and_restores_them(tmp_path, checkpoints):
    """`qwen-jax convert` of an AWQ checkpoint, and of a float one with -q int8, saves the
    stored arrays; restoring gives them back bit for bit (a bf16 restore casts only the
    float params)."""
    from serving.cli.main import main
    for name, source, quantization in (("awq", checkpoints["awq"], None),
                                       ("int8", TINY_MODEL, "int8")):
        extra = ["--quantization", quantization] if quantization else []
        assert main(["convert", "--model", str(source), "--output", str(tmp_path / name),
                     *extra]) == 0
        loaded = Qwen3ForCausalLM.from_pretrained(source, quantization=quantization)
        restored = Qwen3ForCausalLM.from_pretrained(tmp_path / name)
        assert restored.config.quantization == loaded.config.quantization
        saved = dict(nnx.to_flat_state(nnx.state(restored, nnx.Param)))
        for path, var in nnx.to_flat_state(nnx.state(loaded, nnx.Param)):
            np.testing.assert_array_equal(np.asarray(saved[path].get_value()),
                                          np.asarray(var.get_value()), err_msg=str(path))
    bf16 = Qwen3ForCausalLM.from_pretrained(tmp_path / "awq", dtype="bfloat16")
    layer = bf16.segments[0]
    assert layer.input_layernorm.weight[...].dtype == jnp.bfloat16
    assert layer.self_attn.q_proj.kernel[...].dtype == jnp.uint8
    assert layer.self_attn.q_proj.kernel_scale[...].dtype == jnp.float16
