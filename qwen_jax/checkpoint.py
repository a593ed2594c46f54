"""Orbax save/restore of converted params (faster start-up than re-reading safetensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
from flax import nnx

from qwen_jax import sharding
from qwen_jax.config import ModelConfig
from qwen_jax.params import abstract_model, init_buffers, resolve_dtype

PARAMS_DIR = "orbax_params"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def _checkpointer():
    """Orbax is imported on use: importing it costs ~0.5 s and installs a root logging
    handler, which would silence `logging.basicConfig` in every program loading a model."""
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def is_orbax_checkpoint(directory) -> bool:
    return (Path(directory) / PARAMS_DIR).is_dir()


def save(model, directory, *, source_dir=None) -> Path:
    """Write params (orbax), config.json and, from `source_dir`, the tokenizer files."""
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with _checkpointer() as ckptr:
        ckptr.save(directory / PARAMS_DIR, params, force=True)
    with open(directory / "config.json", "w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).exists():
                shutil.copy(Path(source_dir) / name, directory / name)
    return directory


def restore(directory, *, model_cls, dtype=None, impl=None, mesh=None):
    """Restore a `model_cls` saved by `save`; `dtype` casts params if it differs from the
    saved one. With a `mesh`, orbax reads each parameter straight into its target shards."""
    directory = Path(directory).absolute()
    cfg = ModelConfig.from_hf(directory)
    with _checkpointer() as ckptr:
        saved_meta = ckptr.metadata(directory / PARAMS_DIR)
        saved_dtype = jax.tree.leaves(_tree_of(saved_meta))[0].dtype
        model = abstract_model(cfg, saved_dtype, impl, mesh, model_cls=model_cls)
        params = nnx.state(model, nnx.Param)
        if mesh is not None:
            for path, var in nnx.to_flat_state(params):
                value = var.get_value()
                var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=(
                    sharding.param_sharding(path, value.shape, mesh, cfg))))
        target = nnx.to_pure_dict(params)
        restored = ckptr.restore(directory / PARAMS_DIR, target)
    params_state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params_state, restored)
    nnx.update(model, params_state)
    graphdef, state = nnx.split(model)
    init_buffers(state, cfg)
    model = nnx.merge(graphdef, state)
    if dtype is not None and resolve_dtype(dtype) != saved_dtype:
        cast = jax.tree.map(lambda x: x.astype(resolve_dtype(dtype)),
                            nnx.state(model, nnx.Param))
        nnx.update(model, cast)
    return model


def _tree_of(metadata):
    """Orbax metadata objects differ across versions; get the pytree of array metadata."""
    for attr in ("item_metadata", "tree"):
        if hasattr(metadata, attr):
            metadata = getattr(metadata, attr)
    return metadata
