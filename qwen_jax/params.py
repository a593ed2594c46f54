"""Helpers every loader shares (weights, checkpoint, planner): dtype names -> dtypes, the
shape-only model, the buffers derived from the config rather than loaded, and the params
of a quantised weight grouped (its values, scales and zero points load together).

A leaf: it never imports the model module. Loaders receive the model class from
`Qwen3ForCausalLM.from_pretrained` (its `cls`), so `model.py` can import them at the top
without a cycle.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from qwen_jax import sharding
from qwen_jax.config import ModelConfig
from qwen_jax.options import KV_CACHE_DTYPES, PARAM_DTYPES


def resolve_dtype(dtype):
    """A parameter dtype from its name ("bfloat16") or any jnp/numpy dtype."""
    if isinstance(dtype, str):
        if dtype not in PARAM_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(PARAM_DTYPES)}, got {dtype!r}")
        return getattr(jnp, dtype)
    return jnp.dtype(dtype)


def resolve_kv_cache_dtype(name: str, model_dtype):
    """The KV cache's dtype from its option name; "auto" is the model's."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    dtype_name = KV_CACHE_DTYPES[name]
    return model_dtype if dtype_name is None else getattr(jnp, dtype_name)


def abstract_model(cfg: ModelConfig, dtype=jnp.float32, impl=None, mesh=None, *, model_cls):
    """`model_cls(cfg, ...)` with ShapeDtypeStruct leaves: shapes without memory."""
    return nnx.eval_shape(lambda: model_cls(cfg, dtype=resolve_dtype(dtype), impl=impl,
                                            mesh=mesh))


def init_buffers(state: nnx.State, cfg: ModelConfig) -> None:
    """Non-Param variables (the RoPE table) are derived from the config, never loaded."""
    for path, var in nnx.to_flat_state(state):
        if path == ("rope_inv_freq",):
            var.set_value(jnp.asarray(cfg.rope_inv_freq_and_scale[0]))


# ---- params grouped by weight ------------------------------------------------------------
def params_of(state: nnx.State) -> dict:
    """{path: nnx.Param} of a model's state, in its order."""
    return {path: var for path, var in nnx.to_flat_state(state) if isinstance(var, nnx.Param)}


def weight_groups(params: dict) -> dict:
    """{weight path: {"values": path[, "scales": path, "zeros": path]}}: a quantised weight
    and its companions (<name>_scale, <name>_zero) load together; other params alone."""
    groups = {}
    for path in params:
        if sharding.base_name(path[-1]) != path[-1]:
            continue
        group = {"values": path}
        for key, suffix in (("scales", "_scale"), ("zeros", "_zero")):
            if path[:-1] + (path[-1] + suffix,) in params:
                group[key] = path[:-1] + (path[-1] + suffix,)
        groups[path] = group
    return groups


def quantized_paths(state: nnx.State) -> set:
    """Paths of every quantised weight's stored arrays (values, scales, zero points)."""
    return {p for group in weight_groups(params_of(state)).values() if len(group) > 1
            for p in group.values()}


def is_pair(path) -> bool:
    """The experts' gate/up: two matrices stored [..., K, 2, F]."""
    return "gate_up" in sharding.param_logical_axes(path)


def logical_shape(path, stored_shape, cfg: ModelConfig) -> tuple[int, ...]:
    """The float shape of a quantised weight (int4 values hold two K rows per byte)."""
    if cfg.quantization is None or cfg.quantization.weight_format.kind != "int4":
        return tuple(stored_shape)
    k_dim = len(stored_shape) + (-3 if is_pair(path) else -2)
    return tuple(d * 2 if i == k_dim else d for i, d in enumerate(stored_shape))
