"""Model configuration read from a Hugging Face Qwen3 / Qwen3-MoE `config.json`."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import numpy as np

from qwen_jax.quantization import Quantization
from qwen_jax.validation import require

DENSE_ARCH = "Qwen3ForCausalLM"
MOE_ARCH = "Qwen3MoeForCausalLM"
_ARCH_BY_MODEL_TYPE = {"qwen3": DENSE_ARCH, "qwen3_moe": MOE_ARCH}
_ROPE_TYPES = ("default", "linear", "yarn")
PRESET_DIR = Path(__file__).parent / "configs"


def _validate_rope_scaling(rope: dict) -> None:
    rope_type = rope.get("rope_type", "default")
    require(rope_type in _ROPE_TYPES, "rope_parameters.rope_type", rope_type,
            f"one of {', '.join(_ROPE_TYPES)}")
    if rope_type == "linear":
        require(float(rope.get("factor") or 0) > 0, "rope_parameters.factor", rope.get("factor"),
                "> 0")
    if rope_type == "yarn":
        require("original_max_position_embeddings" in rope,
                "rope_parameters.original_max_position_embeddings", None, "set for yarn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The fields of a Qwen3 / Qwen3-MoE model that shape its parameters and numerics."""

    architecture: str = MOE_ARCH
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (dense layers of an MoE model too)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None  # HF rope_parameters minus rope_theta; None = default
    max_position_embeddings: int = 40_960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Weight quantisation: the checkpoint's quantization_config, or --quantization.
    quantization: Quantization | None = None

    def __post_init__(self):
        require(self.architecture in (DENSE_ARCH, MOE_ARCH), "architectures", self.architecture,
                f"one of {DENSE_ARCH}, {MOE_ARCH}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            require(getattr(self, name) > 0, name, getattr(self, name), "> 0")
        require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}")
        require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "even (RoPE rotates pairs)")
        require(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "> 0")
        require(self.hidden_act == "silu", "hidden_act", self.hidden_act,
                "'silu' (the only one supported)")
        require(self.decoder_sparse_step >= 1, "decoder_sparse_step", self.decoder_sparse_step,
                ">= 1")
        require(all(0 <= idx < self.num_hidden_layers for idx in self.mlp_only_layers),
                "mlp_only_layers", list(self.mlp_only_layers),
                f"layer indices in [0, {self.num_hidden_layers})")
        if self.architecture == MOE_ARCH and self.num_experts > 0:
            require(self.moe_intermediate_size > 0, "moe_intermediate_size",
                    self.moe_intermediate_size, "> 0 when num_experts > 0")
            require(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                    self.num_experts_per_tok, f"in [1, num_experts={self.num_experts}]")
        if self.rope_scaling is not None:
            _validate_rope_scaling(self.rope_scaling)

    # ---- derived structure -------------------------------------------------------------
    def is_moe_layer(self, idx: int) -> bool:
        """HF's rule: MoE iff not mlp-only, experts exist, and (idx + 1) % sparse_step == 0."""
        return (self.architecture == MOE_ARCH and idx not in self.mlp_only_layers
                and self.num_experts > 0 and (idx + 1) % self.decoder_sparse_step == 0)

    @functools.cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple("moe" if self.is_moe_layer(i) else "dense"
                     for i in range(self.num_hidden_layers))

    @functools.cached_property
    def segments(self) -> tuple[tuple[str, int, int], ...]:
        """Runs of consecutive same-kind layers: (kind, first layer, count); each is one scan."""
        runs: list[list] = []
        for i, kind in enumerate(self.layer_kinds):
            if runs and runs[-1][0] == kind:
                runs[-1][2] += 1
            else:
                runs.append([kind, i, 1])
        return tuple(tuple(r) for r in runs)

    @property
    def is_moe(self) -> bool:
        return "moe" in self.layer_kinds

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ---- RoPE --------------------------------------------------------------------------
    @functools.cached_property
    def rope_inv_freq_and_scale(self) -> tuple[np.ndarray, float]:
        """Inverse frequencies [H/2] (float32) and the cos/sin scale, as HF computes them."""
        dim = self.head_dim
        base = self.rope_theta
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        inv_freq = (1.0 / pos_freqs).astype(np.float32)
        params = self.rope_scaling or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "linear":
            return (inv_freq / np.float32(params["factor"])).astype(np.float32), 1.0
        if rope_type == "yarn":
            return _yarn(params, dim, base, self.max_position_embeddings, pos_freqs)
        return inv_freq, 1.0

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> "ModelConfig":
        """Parse an HF config: a dict, a `config.json` path, a checkpoint dir, or a preset name."""
        return cls(**_fields_from_hf(_load_hf_dict(path_or_dict)))

    def to_hf_dict(self) -> dict:
        """An HF `config.json` dict (transformers 5 spelling) that `from_hf` reads back."""
        rope = {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"})}
        out = {
            "architectures": [self.architecture],
            "model_type": "qwen3_moe" if self.architecture == MOE_ARCH else "qwen3",
            "rope_parameters": rope,
            "mlp_only_layers": list(self.mlp_only_layers),
        }
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf_dict()
        skip = {"architecture", "rope_theta", "rope_scaling", "mlp_only_layers", "quantization"}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        if self.architecture == DENSE_ARCH:
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                out.pop(key, None)
        return out


def _yarn(params: dict, dim: int, base: float, max_pos: int, pos_freqs: np.ndarray):
    """YaRN inverse frequencies and attention factor, following HF `_compute_yarn_parameters`."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / original

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = (1 - ramp).astype(np.float32)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def _load_hf_dict(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = Path(path_or_dict)
    if not path.exists() and (PRESET_DIR / f"{path_or_dict}.json").exists():
        path = PRESET_DIR / f"{path_or_dict}.json"
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(f"model config not found: {path_or_dict!r} is neither a checkpoint "
                         f"directory with config.json, a config file, nor a preset "
                         f"({', '.join(list_presets())})")
    with open(path) as f:
        return json.load(f)


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if archs:
        require(len(archs) == 1 and archs[0] in (DENSE_ARCH, MOE_ARCH), "architectures", archs,
                f"one of {DENSE_ARCH}, {MOE_ARCH}")
        return archs[0]
    model_type = hf.get("model_type")
    require(model_type in _ARCH_BY_MODEL_TYPE, "model_type", model_type,
            f"one of {', '.join(_ARCH_BY_MODEL_TYPE)}")
    return _ARCH_BY_MODEL_TYPE[str(model_type)]


def _rope_fields(hf: dict) -> tuple[float, dict | None]:
    """Both spellings: top-level rope_theta + rope_scaling (v4) or rope_parameters (v5)."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    if legacy:
        if "type" in legacy and "rope_type" not in legacy:
            legacy["rope_type"] = legacy.pop("type")
        params = {**legacy, **params}
    theta = params.pop("rope_theta", hf.get("rope_theta", 10_000.0))
    if params.get("rope_type", "default") == "default":
        params = {}
    if params.get("rope_type") == "yarn":  # HF's default when the checkpoint omits it
        params.setdefault("original_max_position_embeddings", hf.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 40_960)))
    return float(theta), (params or None)


def _fields_from_hf(hf: dict) -> dict:
    arch = _architecture(hf)
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    require(isinstance(hidden, int) and isinstance(heads, int) and heads > 0,
            "hidden_size/num_attention_heads", (hidden, heads), "positive integers")
    num_experts = hf.get("num_experts", hf.get("num_local_experts", 0)) or 0
    if "num_experts" in hf and "num_local_experts" in hf:
        require(hf["num_experts"] == hf["num_local_experts"], "num_local_experts",
                hf["num_local_experts"], f"equal to num_experts={hf['num_experts']}")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope_theta, rope_scaling = _rope_fields(hf)
    fields = dict(
        architecture=arch, vocab_size=hf.get("vocab_size", 0), hidden_size=hidden,
        intermediate_size=hf.get("intermediate_size", 0),
        num_hidden_layers=hf.get("num_hidden_layers", 0),
        num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim, rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 40_960),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        hidden_act=hf.get("hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id"),
        quantization=(Quantization.from_hf(hf["quantization_config"])
                      if hf.get("quantization_config") else None),
        eos_token_id=tuple(hf["eos_token_id"]) if isinstance(hf.get("eos_token_id"), list)
        else hf.get("eos_token_id"),
    )
    if arch == MOE_ARCH:
        fields.update(
            num_experts=num_experts, num_experts_per_tok=hf.get("num_experts_per_tok", 0),
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    return fields
