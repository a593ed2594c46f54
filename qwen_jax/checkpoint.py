"""Orbax save/restore of converted params (faster start-up than re-reading safetensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
from flax import nnx

from qwen_jax import sharding
from qwen_jax.config import ModelConfig
from qwen_jax.params import abstract_model, init_buffers, quantized_paths, resolve_dtype

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


def restore(directory, *, model_cls, dtype=None, impl=None, mesh=None, quantization=None):
    """Restore a `model_cls` saved by `save`; `dtype` casts the float params if it differs
    from the saved one (quantised weights and their scales stay as stored). With a `mesh`,
    orbax reads each parameter straight into its target shards. quantization: as resolved
    by `load_model` from the saved config and `--quantization` (they must agree)."""
    directory = Path(directory).absolute()
    cfg = ModelConfig.from_hf(directory)
    if quantization != cfg.quantization:
        raise ValueError(f"quantization={quantization and quantization.method!r} does not "
                         f"match the orbax checkpoint {directory}, saved with quantization "
                         f"{cfg.quantization and cfg.quantization.method!r}; quantise at load "
                         "from safetensors, or save a quantised model with qwen-jax convert "
                         "--quantization")
    with _checkpointer() as ckptr:
        saved_meta = ckptr.metadata(directory / PARAMS_DIR)
        saved_dtype = _tree_of(saved_meta)["embed_tokens"].dtype
        model = abstract_model(cfg, saved_dtype, impl, mesh, model_cls=model_cls)
        params = nnx.state(model, nnx.Param)
        if mesh is not None:
            flat = dict(nnx.to_flat_state(params))
            targets = sharding.param_shardings(
                {p: v.get_value().shape for p, v in flat.items()}, mesh, cfg)
            for path, var in flat.items():
                value = var.get_value()
                var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                   sharding=targets[path]))
        target = nnx.to_pure_dict(params)
        restored = ckptr.restore(directory / PARAMS_DIR, target)
    params_state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params_state, restored)
    nnx.update(model, params_state)
    graphdef, state = nnx.split(model)
    init_buffers(state, cfg)
    model = nnx.merge(graphdef, state)
    if dtype is not None and resolve_dtype(dtype) != saved_dtype:
        params = nnx.state(model, nnx.Param)
        stored = quantized_paths(params)
        for path, var in nnx.to_flat_state(params):
            if path not in stored:
                var.set_value(var.get_value().astype(resolve_dtype(dtype)))
        nnx.update(model, params)
    return model


def _tree_of(metadata):
    """Orbax metadata objects differ across versions; get the pytree of array metadata."""
    for attr in ("item_metadata", "tree"):
        if hasattr(metadata, attr):
            metadata = getattr(metadata, attr)
    return metadata
