"""HF safetensors -> model params, read lazily one layer's tensor at a time; dummy init.

Peak host memory stays near one tensor of one layer: stacked device buffers are allocated
once and each layer's slice is written in place by a donated update. The model class comes
from the caller (`Qwen3ForCausalLM.from_pretrained` passes its `cls`): this module never
imports model.py, which imports it.
"""

from __future__ import annotations

import functools
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_jax import checkpoint, sharding
from qwen_jax.config import PRESET_DIR, ModelConfig
from qwen_jax.layers import INIT_STD
from qwen_jax.options import LOAD_FORMATS
from qwen_jax.params import abstract_model, init_buffers, resolve_dtype
from qwen_jax.safetensors_io import CheckpointReader

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "tiny-qwen3-moe"  # what LLM() and `qwen-jax serve` load


def list_models() -> list[str]:
    """Names `resolve_model_path` knows: shipped checkpoints and config presets."""
    shipped = [p.name for p in ASSETS_DIR.iterdir() if (p / "config.json").exists()] \
        if ASSETS_DIR.is_dir() else []
    return sorted(shipped) + sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def resolve_model_path(model: str | Path) -> Path:
    """A checkpoint directory, a checkpoint shipped in the package (its weights), or a
    preset name from qwen_jax/configs (dummy weights)."""
    path = Path(model)
    if path.exists():
        return path
    for candidate in (ASSETS_DIR / str(model), PRESET_DIR / f"{model}.json"):
        if candidate.exists():
            return candidate
    raise ValueError(f"model {str(model)!r} is neither an existing path nor one of "
                     f"{', '.join(list_models())}")


def load_model(model, dtype="float32", *, model_cls, impl=None, load_format="auto", seed=0,
               mesh=None):
    """A `model_cls` from a checkpoint dir (safetensors or orbax) or a preset (dummy)."""
    path = resolve_model_path(model)
    cfg = ModelConfig.from_hf(path)
    dtype = resolve_dtype(dtype)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    if load_format == "dummy" or path.is_file():
        return init_dummy(cfg, dtype, model_cls=model_cls, impl=impl, seed=seed, mesh=mesh)
    if load_format == "orbax" or (load_format == "auto" and checkpoint.is_orbax_checkpoint(path)):
        return checkpoint.restore(path, model_cls=model_cls, dtype=dtype, impl=impl, mesh=mesh)
    return load_safetensors(path, cfg, dtype, model_cls=model_cls, impl=impl, mesh=mesh)


def init_dummy(cfg: ModelConfig, dtype=jnp.float32, *, model_cls, impl=None, seed=0, mesh=None):
    """Random params built directly on device (vLLM's load_format=dummy); under a mesh each
    parameter is generated straight into its shards."""
    dtype = resolve_dtype(dtype)
    if mesh is None:
        return model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(seed), impl=impl)
    graphdef, state = nnx.split(abstract_model(cfg, dtype, impl, mesh, model_cls=model_cls))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        if not isinstance(var, nnx.Param):
            continue
        shape = var.get_value().shape
        target = sharding.param_sharding(path, shape, mesh, cfg)
        is_norm = path[-1] == "weight" and "norm" in str(path[-2])
        make = functools.partial(_dummy_param, shape=shape, dtype=dtype, ones=is_norm)
        var.set_value(jax.jit(make, out_shardings=target)(jax.random.fold_in(key, i)))
    init_buffers(state, cfg)
    return nnx.merge(graphdef, state)


def _dummy_param(key, *, shape, dtype, ones):
    if ones:
        return jnp.ones(shape, dtype)
    return jax.random.normal(key, shape, dtype) * jnp.asarray(INIT_STD, dtype)


# ---- HF name table ---------------------------------------------------------------------
def _hf_linear(reader, name, shape):
    """torch [out, in] -> ours [in, out]."""
    return reader.get(name, (shape[1], shape[0])).T


class StackedExperts:
    """Per-expert HF tensors seen as one [E, ...] array in our layout, read lazily: indexing
    reads only the experts and the slice asked for (one shard's worth)."""

    def __init__(self, reader, names_per_expert: list[tuple[str, ...]], torch_shape, stack_axis):
        self.reader, self.names, self.torch_shape = reader, names_per_expert, torch_shape
        self.stack_axis = stack_axis  # None: one tensor per expert; -2: gate/up stacked
        inner = (torch_shape[1], torch_shape[0])
        self.shape = (len(names_per_expert), *inner[:-1],
                      *(() if stack_axis is None else (2,)), inner[-1])
        self.ndim = len(self.shape)

    def _expert(self, e, inner_index):
        parts = [self.reader.get(n, self.torch_shape).T for n in self.names[e]]
        if self.stack_axis is None:
            return np.asarray(parts[0][inner_index])
        d_idx, two_idx, f_idx = inner_index
        return np.stack([np.asarray(p[d_idx, f_idx]) for p in parts], axis=-2)[:, two_idx]

    def __getitem__(self, index):
        index = tuple(index) + (slice(None),) * (self.ndim - len(tuple(index)))
        experts = range(self.shape[0])[index[0]]
        return np.stack([self._expert(e, index[1:]) for e in experts])

    def __array__(self, dtype=None, copy=None):
        return self[(slice(None),)]


def _hf_experts(reader, prefix, kind, cfg):
    """Per-expert tensors (`experts.{e}.*.weight`) or transformers-5 fused ones, as a lazy
    [E, D, 2, F] (gate_up) or [E, F, D] (down) array."""
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused = f"{prefix}experts.{kind}"
    if kind == "gate_up_proj":
        if fused in reader:  # [E, 2F, D] with gate rows first
            return reader.get(fused, (e, 2 * f, d)).reshape(e, 2, f, d).transpose(0, 3, 1, 2)
        names = [(f"{prefix}experts.{i}.gate_proj.weight", f"{prefix}experts.{i}.up_proj.weight")
                 for i in range(e)]
        return StackedExperts(reader, names, (f, d), stack_axis=-2)
    if fused in reader:
        return reader.get(fused, (e, d, f)).transpose(0, 2, 1)
    names = [(f"{prefix}experts.{i}.down_proj.weight",) for i in range(e)]
    return StackedExperts(reader, names, (d, f), stack_axis=None)


def hf_layer_tensor(reader, cfg, layer_idx: int, subpath: tuple[str, ...], shape) -> np.ndarray:
    """Our per-layer param at `subpath` (e.g. ('self_attn', 'q_proj', 'kernel')) from HF."""
    prefix = f"model.layers.{layer_idx}."
    if subpath in (("mlp", "gate_up_proj"), ("mlp", "down_proj")):
        return _hf_experts(reader, prefix + "mlp.", subpath[1], cfg)
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


def _to_device(host, sharding, dtype):
    """A (lazy) host array onto the device(s): under a mesh each device's slice is read
    on its own (jax.make_array_from_callback), so no full copy is ever materialised."""
    if sharding is None:
        return jnp.asarray(np.asarray(host), dtype)
    return jax.make_array_from_callback(
        tuple(host.shape), sharding, lambda index: np.asarray(host[index]).astype(dtype))


def load_safetensors(directory, cfg: ModelConfig, dtype, *, model_cls, impl=None, mesh=None):
    reader = CheckpointReader(directory)
    model = abstract_model(cfg, dtype, impl, mesh, model_cls=model_cls)
    graphdef, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Param):
            continue
        shape, vdtype = var.get_value().shape, var.get_value().dtype
        target = None if mesh is None else sharding.param_sharding(path, shape, mesh, cfg)
        if path[0] == "segments":
            seg, sub = typing.cast(int, path[1]), tuple(str(p) for p in path[2:])
            _, first, count = cfg.segments[seg]
            layer_target = None if target is None else NamedSharding(mesh, P(*target.spec[1:]))
            buffer = sharding.zeros(shape, vdtype, target)
            for j in range(count):
                host = hf_layer_tensor(reader, cfg, first + j, sub, shape[1:])
                buffer = _set_layer(buffer, _to_device(host, layer_target, vdtype), j)
            var.set_value(buffer)
        else:
            host = hf_global_tensor(reader, cfg, tuple(str(p) for p in path), shape)
            var.set_value(_to_device(host, target, vdtype))
    init_buffers(state, cfg)
    return nnx.merge(graphdef, state)
