"""EAGLE-3 heads as their authors publish them, built from the published description
(vLLM's llama_eagle3.py, SGLang's EAGLE-3 worker), and a PyTorch forward of one to hold
ours to: a directory with config.json and safetensors named midlayer.*, fc.weight,
norm.weight, lm_head.weight, d2t, t2d."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_eagle3_dir(directory, *, vocab_size: int, target_hidden_size: int,
                     num_target_layers: int, hidden_size: int | None = None,
                     draft_vocab_size: int | None = None, num_heads: int = 4,
                     num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 64,
                     aux_layers=None, seed: int = 0, prefix: str = "midlayer.",
                     architecture: str = "LlamaForCausalLMEagle3", embeddings: bool = False,
                     rope_theta: float = 10_000.0, **config_overrides) -> dict:
    """Random weights (norms too) in the published layout; returns the tensors by name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    hidden = hidden_size or target_hidden_size
    draft_vocab = draft_vocab_size or vocab_size
    rand = lambda *shape, scale=0.08: torch.randn(*shape, generator=gen) * scale
    qkv_in = 2 * hidden
    tensors = {
        "fc.weight": rand(hidden, 3 * target_hidden_size),
        f"{prefix}self_attn.q_proj.weight": rand(num_heads * head_dim, qkv_in),
        f"{prefix}self_attn.k_proj.weight": rand(num_kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.v_proj.weight": rand(num_kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, num_heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": rand(intermediate_size, hidden),
        f"{prefix}mlp.up_proj.weight": rand(intermediate_size, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, intermediate_size),
        "lm_head.weight": rand(draft_vocab, hidden, scale=0.5),
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"{prefix}{norm}.weight"] = 1 + rand(hidden, scale=0.2)
    tensors["norm.weight"] = 1 + rand(hidden, scale=0.2)
    # the draft vocabulary: a sorted subset of the target's; d2t[d] = target id - d
    targets = torch.sort(torch.randperm(vocab_size, generator=gen)[:draft_vocab]).values
    tensors["d2t"] = targets - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[targets] = True
    tensors["t2d"] = t2d
    if embeddings:
        tensors["embed_tokens.weight"] = rand(vocab_size, hidden, scale=0.5)
    config = {
        "architectures": [architecture], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate_size, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "hidden_act": "silu",
        "max_position_embeddings": 2048, "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden_size,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    config.update(config_overrides)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    """Neox RoPE over the last dim of x [T, heads, H]."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = positions[:, None].float() * inv[None]
    emb = torch.cat([freqs, freqs], -1)[:, None]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * emb.cos() + rotated * emb.sin()


def torch_eagle3_forward(t: dict, embeds, hidden, *, num_heads: int, num_kv_heads: int,
                         head_dim: int, rope_theta: float = 10_000.0, prefix="midlayer."):
    """One causal pass of the head over T positions: embeds [T, D] (token i + 1's),
    hidden [T, D] (fc's output) -> (draft-vocabulary logits [T, Vd], pre-norm [T, D])."""
    p = lambda name: t[f"{prefix}{name}.weight"]
    num = embeds.shape[0]
    positions = torch.arange(num)
    residual = hidden
    x = torch.cat([_rms(embeds, p("input_layernorm")), _rms(hidden, p("hidden_norm"))], -1)
    q = _rope((x @ p("self_attn.q_proj").T).view(num, num_heads, head_dim), positions,
              rope_theta)
    k = _rope((x @ p("self_attn.k_proj").T).view(num, num_kv_heads, head_dim), positions,
              rope_theta)
    v = (x @ p("self_attn.v_proj").T).view(num, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("tnh,snh->nts", q, k) * head_dim ** -0.5
    scores = scores.masked_fill(~torch.tril(torch.ones(num, num, dtype=torch.bool)), -torch.inf)
    out = torch.einsum("nts,snh->tnh", scores.softmax(-1), v).reshape(num, -1)
    residual = out @ p("self_attn.o_proj").T + residual
    y = _rms(residual, p("post_attention_layernorm"))
    mlp = (torch.nn.functional.silu(y @ p("mlp.gate_proj").T) * (y @ p("mlp.up_proj").T))
    prenorm = mlp @ p("mlp.down_proj").T + residual
    return _rms(prenorm, t["norm.weight"]) @ t["lm_head.weight"].T, prenorm
