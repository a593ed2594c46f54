"""HF safetensors -> model params, read lazily one layer's tensor at a time; dummy init.

Peak host memory stays near one tensor of one layer: stacked device buffers are allocated
once and each layer's slice is written in place by a donated update. The model class comes
from the caller (`Qwen3ForCausalLM.from_pretrained` passes its `cls`): this module never
imports model.py, which imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.quantized import quantize, stored_shapes
from qwen_jax import checkpoint, sharding
from qwen_jax.config import PRESET_DIR, ModelConfig
from qwen_jax.layers import INIT_STD, random_stored
from qwen_jax.options import LOAD_FORMATS
from qwen_jax.params import (
    abstract_model,
    init_buffers,
    is_pair,
    logical_shape,
    params_of,
    resolve_dtype,
    weight_groups,
)
from qwen_jax.quantization import CHECKPOINT_METHODS, WeightFormat
from qwen_jax.quantization import resolve as resolve_quantization
from qwen_jax.quantized_io import float_linear, stored_array, stored_quantized
from qwen_jax.safetensors_io import CheckpointReader

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "tiny-qwen3-moe"  # what LLM() and `qwen-jax serve` load
# its draft model (speculative decoding's draft_model when no model is named)
DEFAULT_DRAFT_DIR = ASSETS_DIR / "tiny-qwen3-draft"
DEFAULT_EAGLE3_DIR = ASSETS_DIR / "tiny-qwen3-eagle3"  # and its EAGLE-3 head (method eagle3)


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
               mesh=None, quantization=None):
    """A `model_cls` from a checkpoint dir (safetensors or orbax) or a preset (dummy).
    quantization: None (the checkpoint's own, if any), or fp8 | int8 | awq (`--quantization`:
    it must match a quantised checkpoint's method; fp8 and int8 quantise a float one at
    load; presets and dummy weights take any)."""
    path = resolve_model_path(model)
    cfg = ModelConfig.from_hf(path)
    dtype = resolve_dtype(dtype)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    dummy = load_format == "dummy" or path.is_file()
    cfg = dataclasses.replace(cfg, quantization=resolve_quantization(
        cfg.quantization, quantization, dummy=dummy))
    if dummy:
        return init_dummy(cfg, dtype, model_cls=model_cls, impl=impl, seed=seed, mesh=mesh)
    if load_format == "orbax" or (load_format == "auto" and checkpoint.is_orbax_checkpoint(path)):
        return checkpoint.restore(path, model_cls=model_cls, dtype=dtype, impl=impl, mesh=mesh,
                                  quantization=cfg.quantization)
    return load_safetensors(path, cfg, dtype, model_cls=model_cls, impl=impl, mesh=mesh)


def init_dummy(cfg: ModelConfig, dtype=jnp.float32, *, model_cls, impl=None, seed=0, mesh=None):
    """Random params built directly on device (vLLM's load_format=dummy); under a mesh each
    parameter is generated straight into its shards (quantised weights: layers.random_stored)."""
    dtype = resolve_dtype(dtype)
    if mesh is None:
        return model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(seed), impl=impl)
    graphdef, state = nnx.split(abstract_model(cfg, dtype, impl, mesh, model_cls=model_cls))
    params = params_of(state)
    targets = sharding.param_shardings({p: v.get_value().shape for p, v in params.items()},
                                       mesh, cfg)
    roles = {p: role for group in weight_groups(params).values() if len(group) > 1
             for role, p in group.items()}
    kind = None if cfg.quantization is None else cfg.quantization.weight_format.kind
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(params.items()):
        value = var.get_value()
        is_norm = path[-1] == "weight" and "norm" in str(path[-2])
        make = functools.partial(_dummy_param, shape=value.shape, dtype=value.dtype,
                                 ones=is_norm, role=roles.get(path), kind=kind)
        var.set_value(jax.jit(make, out_shardings=targets[path])(jax.random.fold_in(key, i)))
    init_buffers(state, cfg)
    return nnx.merge(graphdef, state)


def _dummy_param(key, *, shape, dtype, ones, role=None, kind=None):
    """A random param; role: "values" | "scales" | "zeros" of a quantised weight."""
    if role is not None:
        return random_stored(key, role, shape, dtype, kind)
    if ones:
        return jnp.ones(shape, dtype)
    return jax.random.normal(key, shape, dtype) * jnp.asarray(INIT_STD, dtype)


# ---- loading helpers -------------------------------------------------------------------
def _quantizer(path, fmt: WeightFormat, targets: dict, group: dict, *, layer=False):
    """A jitted float weight -> {key: stored array} for `group`, each made in its shards
    (targets; `layer`: one layer of a stack, its leading dim dropped)."""
    keys = tuple(group)
    outs = None if not targets else tuple(
        _drop_layer_dim(targets[group[k]]) if layer else targets[group[k]] for k in keys)

    def quantize_weight(w):
        q = quantize(w, fmt.kind, group_k=fmt.group_k, group_n=fmt.group_n,
                     pair=is_pair(path))
        stored = {"values": q.values, "scales": q.scales, "zeros": q.zeros}
        return tuple(stored[k] for k in keys)

    fn = jax.jit(quantize_weight, out_shardings=outs)
    return lambda w: dict(zip(keys, fn(w)))


def _drop_layer_dim(target: NamedSharding) -> NamedSharding:
    return NamedSharding(target.mesh, P(*target.spec[1:]))


# ---- HF name table ---------------------------------------------------------------------
class StackedExperts:
    """Per-expert HF linears seen as one [E, K, N] (pair: [E, K, 2, N]) array in our
    layout, read lazily: indexing reads only the experts and the slice asked for (one
    shard's worth). read(module) -> that expert's [K, N] array (a view where it can be)."""

    def __init__(self, read, modules_per_expert: list[tuple[str, ...]], inner_shape, *,
                 pair: bool):
        self.read, self.modules, self.pair = read, modules_per_expert, pair
        k, n = inner_shape
        self.shape = (len(modules_per_expert), k, *((2,) if pair else ()), n)
        self.ndim = len(self.shape)

    def _expert(self, e, inner_index):
        parts = [self.read(m) for m in self.modules[e]]
        if not self.pair:
            return np.asarray(parts[0][inner_index])
        d_idx, two_idx, f_idx = inner_index
        return np.stack([np.asarray(p[d_idx, f_idx]) for p in parts], axis=-2)[:, two_idx]

    def __getitem__(self, index):
        index = tuple(index) + (slice(None),) * (self.ndim - len(tuple(index)))
        experts = range(self.shape[0])[index[0]]
        return np.stack([self._expert(e, index[1:]) for e in experts])

    def __array__(self, dtype=None, copy=None):
        return self[(slice(None),)]


def _expert_modules(prefix: str, kind: str, num_experts: int) -> list[tuple[str, ...]]:
    projections = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    return [tuple(f"{prefix}experts.{e}.{p}" for p in projections) for e in range(num_experts)]


def _hf_experts(reader, prefix, kind, cfg):
    """Per-expert tensors (`experts.{e}.*.weight`, dequantised if stored quantised) or
    transformers-5 fused ones, as a lazy float [E, D, 2, F] (gate_up) or [E, F, D] (down)."""
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused = f"{prefix}experts.{kind}"
    inner = (d, f) if kind == "gate_up_proj" else (f, d)
    if fused in reader and kind == "gate_up_proj":  # [E, 2F, D] with gate rows first
        return reader.get(fused, (e, 2 * f, d)).reshape(e, 2, f, d).transpose(0, 3, 1, 2)
    if fused in reader:
        return reader.get(fused, (e, d, f)).transpose(0, 2, 1)
    return StackedExperts(lambda m: float_linear(reader, m, inner, cfg.quantization),
                          _expert_modules(prefix, kind, e), inner, pair=kind == "gate_up_proj")


def hf_layer_tensor(reader, cfg, layer_idx: int, subpath: tuple[str, ...], shape) -> np.ndarray:
    """Our per-layer float param at `subpath` (e.g. ('self_attn', 'q_proj', 'kernel'))."""
    prefix = f"model.layers.{layer_idx}."
    if subpath in (("mlp", "gate_up_proj"), ("mlp", "down_proj")):
        return _hf_experts(reader, prefix + "mlp.", subpath[1], cfg)
    if subpath == ("mlp", "gate"):
        return float_linear(reader, prefix + "mlp.gate", shape, cfg.quantization)
    leaf = subpath[-1]
    name = prefix + ".".join(subpath[:-1])
    if leaf == "kernel":
        return float_linear(reader, name, shape, cfg.quantization)
    return reader.get(name + (".bias" if leaf == "bias" else ".weight"), shape)


def hf_layer_stored(reader, cfg, layer_idx: int, subpath: tuple[str, ...], shape) -> dict:
    """{role: host array} of a quantised per-layer weight as the checkpoint stores it
    (quantized_io), `shape` its float shape ([K, N]; experts [E, K, (2,) N])."""
    fmt = cfg.quantization.weight_format
    group = (fmt.group_k, fmt.group_n)
    prefix = f"model.layers.{layer_idx}."
    if subpath[0] == "mlp" and len(subpath) == 2:  # the experts
        pair = subpath[1] == "gate_up_proj"
        inner = (shape[1], shape[-1])
        stored = stored_shapes(inner, fmt.kind, group_k=fmt.group_k, group_n=fmt.group_n)
        modules = _expert_modules(prefix + "mlp.", subpath[1], cfg.num_experts)
        return {role: StackedExperts(
            lambda m, role=role: stored_array(reader, m, fmt.kind, role, inner, group),
            modules, stored[role][0], pair=pair) for role in stored}
    return stored_quantized(reader, prefix + ".".join(subpath[:-1]), fmt.kind, tuple(shape),
                            group=group)


def hf_global_tensor(reader, cfg, path: tuple[str, ...], shape) -> np.ndarray:
    if path == ("embed_tokens",):
        return reader.get("model.embed_tokens.weight", shape)
    if path == ("lm_head",):
        return float_linear(reader, "lm_head", shape, cfg.quantization)
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
    quant = cfg.quantization
    if quant is not None and not quant.online and quant.method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config.quant_method is {quant.method!r}: safetensors "
                         f"checkpoints are read as {' or '.join(CHECKPOINT_METHODS)}")
    graphdef, state = nnx.split(abstract_model(cfg, dtype, impl, mesh, model_cls=model_cls))
    params = params_of(state)
    targets = {} if mesh is None else sharding.param_shardings(
        {p: v.get_value().shape for p, v in params.items()}, mesh, cfg)
    for path, group in weight_groups(params).items():
        if path[0] == "segments":
            _load_stacked(reader, cfg, path, group, params, targets, dtype)
        else:
            value = params[path].get_value()
            host = hf_global_tensor(reader, cfg, tuple(str(p) for p in path), value.shape)
            params[path].set_value(_to_device(host, targets.get(path), value.dtype))
    init_buffers(state, cfg)
    return nnx.merge(graphdef, state)


def _load_stacked(reader, cfg, path, group, params, targets, dtype) -> None:
    """One stacked weight (and its companions): device buffers [X, ...] allocated once,
    each layer read and written in place."""
    _, first, count = cfg.segments[typing.cast(int, path[1])]
    buffers = {role: sharding.zeros(params[p].get_value().shape, params[p].get_value().dtype,
                                    targets.get(p)) for role, p in group.items()}
    read_layer = _layer_reader(reader, cfg, path, group, params, targets, dtype)
    for j in range(count):
        for role, value in read_layer(first + j).items():
            buffers[role] = _set_layer(buffers[role], value, j)
    for role, p in group.items():
        params[p].set_value(buffers[role])


def _layer_reader(reader, cfg, path, group, params, targets, dtype):
    """layer index -> {role: device array} of that layer of the stacked weight at `path`:
    a float param; a quantised one as the checkpoint stores it; or (online quantisation)
    read in the model dtype and quantised on the device, in its shards."""
    sub = tuple(str(p) for p in path[2:])
    where = {role: _drop_layer_dim(targets[p]) if targets else None for role, p in group.items()}
    dtypes = {role: params[p].get_value().dtype for role, p in group.items()}
    if len(group) == 1:
        shape = params[path].get_value().shape[1:]
        return lambda i: {"values": _to_device(hf_layer_tensor(reader, cfg, i, sub, shape),
                                               where["values"], dtypes["values"])}
    shape = logical_shape(path, params[path].get_value().shape, cfg)[1:]
    if cfg.quantization.online:
        quantize_layer = _quantizer(path, cfg.quantization.weight_format, targets, group,
                                    layer=True)
        return lambda i: quantize_layer(_to_device(hf_layer_tensor(reader, cfg, i, sub, shape),
                                                   where["values"], dtype))
    return lambda i: {role: _to_device(host, where[role], dtypes[role]) for role, host in
                      hf_layer_stored(reader, cfg, i, sub, shape).items()}
