"""Tiny random HF transformers models saved with save_pretrained, for parity tests."""

from __future__ import annotations

import torch

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
            rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def save_hf_model(directory, *, moe: bool = True, seed: int = 0, dtype=torch.float32, **overrides):
    """Build a tiny Qwen3(-MoE) with random weights and save it; returns the HF model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    fields = {**BASE, **(MOE if moe else {}), **overrides}
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**fields))
    # HF initialises norms to ones; randomise them so a mis-mapped norm cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model = model.to(dtype).eval()
    model.save_pretrained(directory)
    return model


def hf_logits(model, input_ids):
    with torch.no_grad():
        return model(torch.as_tensor(input_ids)).logits.float().numpy()
