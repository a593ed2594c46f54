"""Helpers every loader shares (weights, checkpoint, planner): dtype names -> dtypes, the
shape-only model, and the buffers derived from the config rather than loaded.

A leaf: it never imports the model module. Loaders receive the model class from
`Qwen3ForCausalLM.from_pretrained` (its `cls`), so `model.py` can import them at the top
without a cycle.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

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
