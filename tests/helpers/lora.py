"""LoRA adapters for tests: saved by peft from a tiny HF model, or written by hand in the
transformers-4 per-expert layout, plus their reference deltas in our layouts ([in, out] or
[E, in, out] per `(HF layer, module)`, module names as in `qwen_jax.lora.LoRAAdapter`)."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from qwen_jax.config import ModelConfig
from qwen_jax.lora import MLP_PROJS, module_dims

Deltas = dict[tuple[int, str], np.ndarray]
PREFIX = "base_model.model."


def save_peft_adapter(hf_model, directory, *, target_modules=None, target_parameters=None,
                      r: int = 4, alpha: float = 8, use_rslora: bool = False, seed: int = 0,
                      **config):
    """Wrap a deep copy of `hf_model` with random (non-zero) LoRA, save it; returns the peft
    model (the caller's model stays clean, a reference for `merged_deltas`)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules,
                      target_parameters=target_parameters, use_rslora=use_rslora,
                      init_lora_weights=False, **config)
    peft_model = get_peft_model(copy.deepcopy(hf_model), lora)
    peft_model.save_pretrained(str(directory))
    return peft_model


def load_peft_adapter(hf_model, directory):
    """peft's own load of an adapter directory onto a deep copy of `hf_model`."""
    from peft import PeftModel
    return PeftModel.from_pretrained(copy.deepcopy(hf_model), str(directory))


def merged_deltas(peft_model, hf_model) -> Deltas:
    """What merging the adapter changes, per weight, in our layouts (peft's reference)."""
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    base = hf_model.state_dict()
    out: Deltas = {}
    for name, weight in merged.items():
        delta = (weight.float() - base[name].float()).numpy()
        if not np.any(delta):
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name.removesuffix(".weight"))
        assert m is not None, name
        out[(int(m[1]), m[2])] = delta.T if delta.ndim == 2 else delta.transpose(0, 2, 1)
    return out


def adapter_deltas(adapter) -> Deltas:
    """A @ B of every module of a loaded `LoRAAdapter`."""
    return {key: a @ b for key, (a, b) in adapter.modules.items()}


def apply_deltas(hf_model, deltas: Deltas):
    """A deep copy of `hf_model` with `deltas` (our layouts) added to its weights."""
    model = copy.deepcopy(hf_model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for (layer, module), delta in deltas.items():
            name = f"model.layers.{layer}.{module}"
            param = params[name] if name in params else params[f"{name}.weight"]
            hf = delta.T if delta.ndim == 2 else delta.transpose(0, 2, 1)
            param += torch.as_tensor(np.ascontiguousarray(hf), dtype=param.dtype)
    return model


def _pattern(patterns: dict, name: str, default):
    from peft.utils.other import get_pattern_key
    return patterns.get(get_pattern_key(patterns.keys(), name), default)


def save_per_expert_adapter(directory, cfg: ModelConfig, *, r: int = 4, alpha: float = 8,
                            use_rslora: bool = False, projections=MLP_PROJS, attention=(),
                            dense_mlp: bool = True, rank_pattern=None, alpha_pattern=None,
                            seed: int = 0, drop=()) -> Deltas:
    """Write the transformers-4 layout by hand: `mlp.experts.<e>.<proj>` LoRA in MoE layers,
    `mlp.<proj>` in dense ones (if `dense_mlp`), `self_attn.<proj>` for `attention`. `drop`
    lists file modules (e.g. "layers.0.mlp.experts.3.up_proj") to leave out. Returns the
    deltas it meant, stacked per expert."""
    rng = np.random.default_rng(seed)
    rank_pattern, alpha_pattern = dict(rank_pattern or {}), dict(alpha_pattern or {})
    tensors: dict[str, np.ndarray] = {}
    deltas: Deltas = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        groups = [("self_attn", p, None) for p in attention]
        if kind == "moe":
            groups += [("mlp.experts", p, e) for p in projections for e in range(cfg.num_experts)]
        elif dense_mlp:
            groups += [("mlp", p, None) for p in projections]
        for group, proj, expert in groups:
            file_module = f"{group}.{proj}" if expert is None else f"{group}.{expert}.{proj}"
            full = f"model.layers.{layer}.{file_module}"
            if any(full.endswith(d) for d in drop):
                continue
            rank = _pattern(rank_pattern, full, r)
            scale = _pattern(alpha_pattern, full, alpha) / (math.sqrt(rank) if use_rslora
                                                             else rank)
            lead, d_in, d_out = module_dims(cfg, layer, f"{group}.{proj}")
            a = rng.standard_normal((rank, d_in)).astype(np.float32) * 0.3
            b = rng.standard_normal((d_out, rank)).astype(np.float32) * 0.3
            tensors[f"{PREFIX}{full}.lora_A.weight"] = a
            tensors[f"{PREFIX}{full}.lora_B.weight"] = b
            delta = (scale * (b @ a)).T.astype(np.float32)  # [in, out]
            if expert is None:
                deltas[(layer, f"{group}.{proj}")] = delta
            else:
                stack = deltas.setdefault((layer, f"{group}.{proj}"),
                                          np.zeros((*lead, d_in, d_out), np.float32))
                stack[expert] = delta
    targets = [*attention, *projections]
    write_adapter(directory, tensors, {"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                       "use_rslora": use_rslora, "target_modules": targets,
                                       "rank_pattern": rank_pattern,
                                       "alpha_pattern": alpha_pattern, "bias": "none"})
    return deltas


def write_adapter(directory, tensors: dict[str, np.ndarray], config: dict) -> None:
    """Write adapter_model.safetensors and adapter_config.json into `directory`."""
    from safetensors.numpy import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))


def read_adapter(directory) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, config) of an adapter directory, for tests that edit one."""
    from safetensors.numpy import load_file
    directory = Path(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    return dict(load_file(str(directory / "adapter_model.safetensors"))), config


def _delta_or_zeros(cfg: ModelConfig, deltas: Deltas, layer: int, module: str) -> np.ndarray:
    lead, d_in, d_out = module_dims(cfg, layer, module)
    return deltas.get((layer, module), np.zeros((*lead, d_in, d_out), np.float32))


def grouped_deltas(cfg: ModelConfig, deltas: Deltas) -> Deltas:
    """Per layer, the deltas of the packed buffer pairs: `qkv` [D, (N+2K)H] (q | k | v
    columns), `o`, `gate_up` [..., D, 2F] (gate | up columns) and `down`; zeros if absent."""
    out: Deltas = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        group = "mlp.experts" if kind == "moe" else "mlp"
        qkv = [_delta_or_zeros(cfg, deltas, layer, f"self_attn.{p}")
               for p in ("q_proj", "k_proj", "v_proj")]
        out[(layer, "qkv")] = np.concatenate(qkv, axis=-1)
        out[(layer, "o")] = _delta_or_zeros(cfg, deltas, layer, "self_attn.o_proj")
        gate_up = np.concatenate([_delta_or_zeros(cfg, deltas, layer, f"{group}.{p}")
                                  for p in ("gate_proj", "up_proj")], axis=-1)
        if (layer, "mlp.experts.gate_up_proj") in deltas:
            gate_up = gate_up + deltas[(layer, "mlp.experts.gate_up_proj")]
        out[(layer, "gate_up")] = gate_up
        out[(layer, "down")] = _delta_or_zeros(cfg, deltas, layer, f"{group}.down_proj")
    return out


def packed_deltas(cfg: ModelConfig, packed: list[dict[str, np.ndarray]]) -> Deltas:
    """The same per-layer deltas computed from `pack_adapter`'s buffers."""
    out: Deltas = {}
    for seg, (_, first, count) in zip(packed, cfg.segments):
        for x in range(count):
            layer = first + x
            gate_up_b = seg["mlp.lora_gate_up_b"][x].astype(np.float32)
            out[(layer, "qkv")] = seg["self_attn.lora_qkv_a"][x] @ seg["self_attn.lora_qkv_b"][x]
            out[(layer, "o")] = seg["self_attn.lora_o_a"][x] @ seg["self_attn.lora_o_b"][x]
            out[(layer, "gate_up")] = seg["mlp.lora_gate_up_a"][x] @ gate_up_b.reshape(
                *gate_up_b.shape[:-3], gate_up_b.shape[-3], -1)
            out[(layer, "down")] = seg["mlp.lora_down_a"][x] @ seg["mlp.lora_down_b"][x]
    return out
