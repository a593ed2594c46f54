"""EAGLE-3 draft heads (speculative decoding's method `eagle3`), loaded as their authors
publish them: a directory with `config.json` (`LlamaForCausalLMEagle3` /
`Eagle3LlamaForCausalLM`) and safetensors named `midlayer.*` (or `layers.0.*`), `fc.weight`,
`norm.weight`, `lm_head.weight`, `d2t` and `t2d` (`embed_tokens.weight` when the head has
embeddings of its own; otherwise it reads the target's).

The head is one Llama decoder layer fed two things per position i: the target's hidden
states entering three of its layers (`eagle_aux_hidden_state_layer_ids`, vLLM's indexing:
id j is what enters layer j), combined by `fc` [3 * target_hidden -> hidden], and the
embedding of token i + 1. Its attention's q/k/v read [input_layernorm(embedding),
hidden_norm(hidden)] (2 * hidden wide); the residual stream starts at the hidden state
(or at its norm, `norm_before_residual`). Its output at i, through `norm` and `lm_head`
over a reduced draft vocabulary, predicts token i + 2; draft id d is target id d + d2t[d].
Drafting further feeds the layer's pre-norm output back as the hidden state of the next
position (no `fc`), with the draft just drawn as its token.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen_jax import sharding
from qwen_jax.attention import StepContext, paged_attention
from qwen_jax.config import ModelConfig, _rope_fields
from qwen_jax.layers import Linear, RMSNorm, Runtime, init_param, rotate
from qwen_jax.safetensors_io import CheckpointReader
from qwen_jax.validation import require

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FIELD = "speculative_config.model"


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's choice when the head's config names none: (2, L // 2, L - 3)."""
    return 2, num_target_layers // 2, num_target_layers - 3


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False

    @classmethod
    def from_hf(cls, hf: dict, target: ModelConfig) -> Eagle3Config:
        """Parse a head's config.json against the target it drafts for; a head that does
        not fit the target is refused naming the field."""
        archs = hf.get("architectures") or []
        require(len(archs) == 1 and archs[0] in ARCHITECTURES, f"{FIELD}'s architectures",
                archs, f"one of {', '.join(ARCHITECTURES)}")
        require(hf.get("num_hidden_layers", 1) == 1, f"{FIELD}'s num_hidden_layers",
                hf.get("num_hidden_layers"), "1 (an EAGLE-3 head is one decoder layer)")
        require(hf.get("hidden_act", "silu") == "silu", f"{FIELD}'s hidden_act",
                hf.get("hidden_act"), "silu")
        require(not hf.get("attention_bias") and not hf.get("mlp_bias"),
                f"{FIELD}'s attention_bias/mlp_bias", True, "false")
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        eagle = hf.get("eagle_config") or {}
        aux = (hf.get("eagle_aux_hidden_state_layer_ids")
               or eagle.get("eagle_aux_hidden_state_layer_ids")
               or default_aux_layers(target.num_hidden_layers))
        layers = target.num_hidden_layers
        require(len(aux) == 3 and all(isinstance(i, int) and 0 <= i < layers for i in aux),
                f"{FIELD}'s eagle_aux_hidden_state_layer_ids", list(aux),
                f"three layer ids in [0, {layers}) (the target has {layers} layers)")
        theta, scaling = _rope_fields(hf)
        config = cls(
            hidden_size=hidden, target_hidden_size=hf.get("target_hidden_size", hidden),
            intermediate_size=hf["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads, vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            aux_layer_ids=tuple(aux), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            norm_before_residual=bool(hf.get("norm_before_residual", False)))
        require(config.target_hidden_size == target.hidden_size,
                f"{FIELD}'s target_hidden_size", config.target_hidden_size,
                f"the target's hidden_size {target.hidden_size}")
        require(config.vocab_size == target.vocab_size, f"{FIELD}'s vocab_size",
                config.vocab_size, f"the target's vocab_size {target.vocab_size}")
        require(config.draft_vocab_size <= config.vocab_size, f"{FIELD}'s draft_vocab_size",
                config.draft_vocab_size, f"<= vocab_size {config.vocab_size}")
        return config

    def to_hf_dict(self) -> dict:
        out = {"architectures": [ARCHITECTURES[0]], "model_type": "llama",
               "num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "aux_layer_ids":
                out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(value)}
            elif field.name != "rope_scaling" or value:
                out[field.name] = value
        return out

    @property
    def rope(self) -> tuple[np.ndarray, float]:
        """(inv_freq, scale) as a Qwen3 of the same head_dim and RoPE computes them."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings).rope_inv_freq_and_scale


class Eagle3Head(nnx.Module):
    def __init__(self, cfg: Eagle3Config, *, own_embeddings: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None, mesh=None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        d, n, k, h = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim)
        linear = lambda i, o: Linear(i, o, dtype=dtype, rngs=rngs)
        self.config = cfg
        self.mesh = mesh
        self.fc = linear(3 * cfg.target_hidden_size, d)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj = (linear(2 * d, n * h), linear(2 * d, k * h),
                                                 linear(2 * d, k * h))
        self.o_proj = linear(n * h, d)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.gate_proj, self.up_proj = linear(d, cfg.intermediate_size), linear(
            d, cfg.intermediate_size)
        self.down_proj = linear(cfg.intermediate_size, d)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = init_param(rngs, (d, cfg.draft_vocab_size), dtype)  # [D, Vd]
        self.d2t = nnx.Variable(jnp.zeros(cfg.draft_vocab_size, jnp.int32))
        self.embed_tokens = (init_param(rngs, (cfg.vocab_size, d), dtype) if own_embeddings
                             else None)
        inv_freq, scale = cfg.rope
        self.rope_inv_freq = nnx.Variable(jnp.asarray(inv_freq))
        self.rope_scale = float(scale)

    @property
    def dtype(self):
        return self.fc.kernel.dtype

    @property
    def num_cache_kv_heads(self) -> int:
        k = self.config.num_key_value_heads
        return k * sharding.kv_replication(k, self.mesh)

    def init_kv_cache(self, num_pages: int, page_size: int, dtype=None):
        """The head's one layer of K/V over the target's page ids: [P, L, K', H] each."""
        shape = (num_pages, page_size, self.num_cache_kv_heads, self.config.head_dim)
        device = None if self.mesh is None else sharding.kv_cache_sharding(self.mesh)
        return tuple(sharding.zeros(shape, dtype or self.dtype, device) for _ in range(2))

    def qkv(self, embeds, hidden):
        """The layer's input [T, 2D] and residual start [T, D] (vLLM's order)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        return jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1), residual

    def project(self, x, cos, sin):
        """x [T, 2D] -> q [T, N, H], k, v [T, K, H] (RoPE applied)."""
        t, cfg = x.shape[0], self.config
        n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = rotate(self.q_proj(x).reshape(t, n, h), cos, sin)
        kk = rotate(self.k_proj(x).reshape(t, k, h), cos, sin)
        return q, kk, self.v_proj(x).reshape(t, k, h)

    def finish(self, attn_out, residual):
        """Attention output [T, N*H] -> (normed [T, D] for the logits, pre-norm [T, D])."""
        residual = self.o_proj(attn_out) + residual
        x = self.post_attention_layernorm(residual)
        prenorm = self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)) + residual
        return self.norm(prenorm), prenorm

    def __call__(self, embeds, hidden, kv_cache, ctx: StepContext, rt: Runtime):
        """embeds, hidden: [T, D] (hidden: fc's output, or the pre-norm output of the
        position before) -> (normed [T, D], pre-norm [T, D], updated kv_cache)."""
        x, residual = self.qkv(embeds, hidden)
        q, k, v = self.project(x, ctx.cos, ctx.sin)
        copies = sharding.kv_replication(self.config.num_key_value_heads, rt.mesh)
        if copies > 1:
            k, v = jnp.repeat(k, copies, axis=1), jnp.repeat(v, copies, axis=1)
        out, kv_cache = paged_attention(q, k, v, kv_cache, ctx, 0, self.config.head_dim ** -0.5,
                                        rt)
        normed, prenorm = self.finish(out.reshape(out.shape[0], -1), residual)
        return normed, prenorm, kv_cache

    def draft_tokens(self, normed):
        """Greedy drafts as target token ids: argmax over the draft vocabulary, mapped."""
        logits = jnp.einsum("...d,dv->...v", normed, self.lm_head[...],
                            preferred_element_type=jnp.float32)
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return best + self.d2t[...][best]


# ---- checkpoints -------------------------------------------------------------------------
_LINEARS = {"fc": "fc", "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
            "self_attn.v_proj": "v_proj", "self_attn.o_proj": "o_proj",
            "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "down_proj"}
_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def _hf_names(reader: CheckpointReader) -> dict[str, str]:
    """Our canonical names (midlayer.*, fc.weight, ...) -> the checkpoint's spelling."""
    names = {}
    for name in reader.keys():
        canonical = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        names[canonical] = name
    return names


def load_eagle3(path, target: ModelConfig, dtype, *, mesh=None) -> Eagle3Head:
    """An EAGLE-3 head from its directory, checked against the target's config."""
    path = Path(path)
    require((path / "config.json").is_file(), FIELD, str(path),
            "an EAGLE-3 head's directory (config.json and safetensors)")
    cfg = Eagle3Config.from_hf(json.loads((path / "config.json").read_text()), target)
    reader = CheckpointReader(path)
    names = _hf_names(reader)
    own = "embed_tokens.weight" in names
    require(own or cfg.hidden_size == target.hidden_size, f"{FIELD}'s hidden_size",
            cfg.hidden_size, f"the target's hidden_size {target.hidden_size} (the head has "
            f"no embed_tokens of its own: it reads the target's)")
    head = Eagle3Head(cfg, own_embeddings=own, dtype=dtype, mesh=mesh)

    def get(name, shape):
        require(name in names, f"{FIELD}'s tensors", sorted(names), f"to include {name}")
        return np.asarray(reader.get(names[name], shape))

    for hf, ours in _LINEARS.items():
        layer = getattr(head, ours)
        key = "fc.weight" if hf == "fc" else f"midlayer.{hf}.weight"
        out_dim, in_dim = layer.kernel.shape[1], layer.kernel.shape[0]
        layer.kernel.set_value(jnp.asarray(get(key, (out_dim, in_dim)).T, dtype))
    for norm in _NORMS:
        module = getattr(head, norm)
        module.weight.set_value(jnp.asarray(get(f"midlayer.{norm}.weight",
                                                module.weight.shape), dtype))
    head.norm.weight.set_value(jnp.asarray(get("norm.weight", (cfg.hidden_size,)), dtype))
    head.lm_head.set_value(jnp.asarray(get(
        "lm_head.weight", (cfg.draft_vocab_size, cfg.hidden_size)).T, dtype))
    if head.embed_tokens is not None:
        head.embed_tokens.set_value(jnp.asarray(get(
            "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)), dtype))
    if "d2t" in names:
        d2t = get("d2t", (cfg.draft_vocab_size,)).astype(np.int64)
        targets = np.arange(cfg.draft_vocab_size) + d2t
        require(bool(np.all((targets >= 0) & (targets < cfg.vocab_size))), f"{FIELD}'s d2t",
                "ids out of range", f"offsets mapping draft ids into [0, {cfg.vocab_size})")
        head.d2t.set_value(jnp.asarray(d2t, jnp.int32))
    else:
        require(cfg.draft_vocab_size == cfg.vocab_size, f"{FIELD}'s tensors", "no d2t",
                "to include d2t when draft_vocab_size < vocab_size")
    if mesh is not None:  # small: every device holds it whole
        _, state = nnx.split(head)
        nnx.update(head, jax.device_put(state, sharding.replicated(mesh)))
    return head


def hf_tensors(head: Eagle3Head) -> dict[str, np.ndarray]:
    """The head's weights under the published names (torch [out, in] layouts)."""
    out = {}
    for hf, ours in _LINEARS.items():
        key = "fc.weight" if hf == "fc" else f"midlayer.{hf}.weight"
        out[key] = np.asarray(getattr(head, ours).kernel[...]).T
    for norm in _NORMS:
        out[f"midlayer.{norm}.weight"] = np.asarray(getattr(head, norm).weight[...])
    out["norm.weight"] = np.asarray(head.norm.weight[...])
    out["lm_head.weight"] = np.asarray(head.lm_head[...]).T
    d2t = np.asarray(head.d2t[...]).astype(np.int64)
    out["d2t"] = d2t
    t2d = np.zeros(head.config.vocab_size, np.bool_)
    t2d[np.arange(d2t.shape[0]) + d2t] = True
    out["t2d"] = t2d
    if head.embed_tokens is not None:
        out["embed_tokens.weight"] = np.asarray(head.embed_tokens[...])
    return {k: np.ascontiguousarray(v if v.dtype != np.float32 else v.astype(np.float32))
            for k, v in out.items()}


def save_eagle3(head: Eagle3Head, directory) -> None:
    from safetensors.numpy import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(head), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(head.config.to_hf_dict(), indent=2) + "\n")


__all__ = ["ARCHITECTURES", "Eagle3Config", "Eagle3Head", "default_aux_layers", "hf_tensors",
           "load_eagle3", "save_eagle3"]
