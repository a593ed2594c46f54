"""HF safetensors -> model params, read lazily one layer's tensor at a time; dummy init.

Peak host memory stays near one tensor of one layer: stacked device buffers are allocated
once and each layer's slice is written in place by a donated update.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen_jax.config import PRESET_DIR, ModelConfig
from qwen_jax.model import Qwen3ForCausalLM
from qwen_jax.safetensors_io import CheckpointReader

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    return jnp.dtype(dtype)


def resolve_model_path(model: str | Path) -> Path:
    """A checkpoint directory, or a preset name from qwen_jax/configs (dummy weights)."""
    path = Path(model)
    if path.exists():
        return path
    preset = PRESET_DIR / f"{model}.json"
    if preset.exists():
        return preset
    raise ValueError(f"model {str(model)!r} is neither an existing path nor a preset "
                     f"({', '.join(sorted(p.stem for p in PRESET_DIR.glob('*.json')))})")


def load_model(model, dtype="float32", *, impl=None, load_format="auto", seed=0):
    """Build a Qwen3ForCausalLM from a checkpoint dir (safetensors or orbax) or a preset."""
    path = resolve_model_path(model)
    cfg = ModelConfig.from_hf(path)
    dtype = resolve_dtype(dtype)
    if load_format not in ("auto", "dummy", "safetensors", "orbax"):
        raise ValueError(f"load_format must be auto, dummy, safetensors or orbax, got {load_format!r}")
    if load_format == "dummy" or path.is_file():
        return init_dummy(cfg, dtype, impl=impl, seed=seed)
    from qwen_jax import checkpoint
    if load_format == "orbax" or (load_format == "auto" and checkpoint.is_orbax_checkpoint(path)):
        return checkpoint.restore(path, dtype=dtype, impl=impl)
    return load_safetensors(path, cfg, dtype, impl=impl)


def init_dummy(cfg: ModelConfig, dtype=jnp.float32, *, impl=None, seed=0) -> Qwen3ForCausalLM:
    """Random params built directly on device (vLLM's load_format=dummy)."""
    return Qwen3ForCausalLM(cfg, dtype=resolve_dtype(dtype), rngs=nnx.Rngs(seed), impl=impl)


def abstract_model(cfg: ModelConfig, dtype=jnp.float32, impl=None) -> Qwen3ForCausalLM:
    """The model with ShapeDtypeStruct leaves: shapes without memory."""
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, dtype=resolve_dtype(dtype), impl=impl))


def param_count(cfg: ModelConfig) -> int:
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


# ---- HF name table ---------------------------------------------------------------------
def _hf_linear(reader, name, shape):
    """torch [out, in] -> ours [in, out]."""
    return reader.get(name, (shape[1], shape[0])).T


def _hf_experts(reader, prefix, kind, cfg, shape):
    """Per-expert tensors (`experts.{e}.*.weight`) or transformers-5 fused ones, -> [E, ...]."""
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused = f"{prefix}experts.{kind}"
    if kind == "gate_up_proj":
        if fused in reader:
            return reader.get(fused, (e, 2 * f, d)).transpose(0, 2, 1)
        gate = [reader.get(f"{prefix}experts.{i}.gate_proj.weight", (f, d)).T for i in range(e)]
        up = [reader.get(f"{prefix}experts.{i}.up_proj.weight", (f, d)).T for i in range(e)]
        return np.concatenate([np.stack(gate), np.stack(up)], axis=-1)  # [E, D, 2F]
    if fused in reader:
        return reader.get(fused, (e, d, f)).transpose(0, 2, 1)
    return np.stack([reader.get(f"{prefix}experts.{i}.down_proj.weight", (d, f)).T
                     for i in range(e)])  # [E, F, D]


def hf_layer_tensor(reader, cfg, layer_idx: int, subpath: tuple[str, ...], shape) -> np.ndarray:
    """Our per-layer param at `subpath` (e.g. ('self_attn', 'q_proj', 'kernel')) from HF."""
    prefix = f"model.layers.{layer_idx}."
    if subpath in (("mlp", "gate_up_proj"), ("mlp", "down_proj")):
        return _hf_experts(reader, prefix + "mlp.", subpath[1], cfg, shape)
    if subpath == ("mlp", "gate"):
        return _hf_linear(reader, prefix + "mlp.gate.weight", shape)
    leaf = subpath[-1]
    name = prefix + ".".join(subpath[:-1])
    if leaf == "kernel":
        return _hf_linear(reader, name + ".weight", shape)
    return reader.get(name + (".bias" if leaf == "bias" else ".weight"), shape)


def hf_global_tensor(reader, cfg, path: tuple[str, ...], shape) -> np.ndarray:
    if path == ("embed_tokens",):
        return reader.get("model.embed_tokens.weight", shape)
    if path == ("lm_head",):
        return _hf_linear(reader, "lm_head.weight", shape)
    if path == ("norm", "weight"):
        return reader.get("model.norm.weight", shape)
    raise ValueError(f"no HF tensor maps to parameter {'/'.join(map(str, path))}")


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buffer, value, index):
    return buffer.at[index].set(value.astype(buffer.dtype))


def load_safetensors(directory, cfg: ModelConfig, dtype, *, impl=None) -> Qwen3ForCausalLM:
    reader = CheckpointReader(directory)
    model = abstract_model(cfg, dtype, impl)
    graphdef, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Param):
            continue
        shape, vdtype = var.get_value().shape, var.get_value().dtype
        if path[0] == "segments":
            seg, sub = path[1], tuple(path[2:])
            _, first, count = cfg.segments[seg]
            buffer = jnp.zeros(shape, vdtype)
            for j in range(count):
                host = hf_layer_tensor(reader, cfg, first + j, sub, shape[1:])
                buffer = _set_layer(buffer, jnp.asarray(host), j)
            var.set_value(buffer)
        else:
            var.set_value(jnp.asarray(hf_global_tensor(reader, cfg, tuple(path), shape), vdtype))
    _restore_buffers(state, cfg)
    return nnx.merge(graphdef, state)


def _restore_buffers(state, cfg: ModelConfig) -> None:
    """Non-Param variables (the RoPE table) are derived from the config, not loaded."""
    for path, var in nnx.to_flat_state(state):
        if path == ("rope_inv_freq",):
            var.set_value(jnp.asarray(cfg.rope_inv_freq_and_scale[0]))
