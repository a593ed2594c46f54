"""Packing a loaded PEFT adapter (qwen_jax/lora.py's `LoRAAdapter`) into the engine's
per-segment slot buffers (qwen_jax/lora_layers.py holds them on the device).

Layout per segment of `cfg.segments` (X layers, R the buffers' rank): q/k/v share one A
[X, D, 3R] and one B [X, 3R, q + 2 kv] (each projection its own R rows and its own output
columns), so one pair of matmuls applies all three; the experts' gate/up likewise share
[.., D, 2R] and [.., 2R, 2, F]. Empty rows and columns are zeros: a module an adapter
lacks adds nothing.
"""

from __future__ import annotations

import numpy as np

from qwen_jax.config import ModelConfig
from qwen_jax.lora import GATE_UP, Factors, LoRAAdapter, module_dims
from qwen_jax.validation import require


def lora_buffer_shapes(cfg: ModelConfig, rank: int) -> list[dict[str, tuple[int, ...]]]:
    """Per segment of `cfg.segments` (X layers): buffer name -> shape [X, ...], R = `rank`."""
    require(isinstance(rank, int) and rank >= 1, "rank", rank, "an integer >= 1")
    d, heads = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    qkv = heads + 2 * cfg.num_key_value_heads * cfg.head_dim
    out = []
    for kind, _, count in cfg.segments:
        lead = (count, cfg.num_experts) if kind == "moe" else (count,)
        f = cfg.moe_intermediate_size if kind == "moe" else cfg.intermediate_size
        shapes = {
            "self_attn.lora_qkv_a": (count, d, 3 * rank),
            "self_attn.lora_qkv_b": (count, 3 * rank, qkv),
            "self_attn.lora_o_a": (count, heads, rank),
            "self_attn.lora_o_b": (count, rank, d),
            "mlp.lora_gate_up_a": (*lead, d, 2 * rank),
            "mlp.lora_gate_up_b": (*lead, 2 * rank, 2, f),
            "mlp.lora_down_a": (*lead, f, rank),
            "mlp.lora_down_b": (*lead, rank, d),
        }
        if kind == "moe":
            shapes |= {"mlp.lora_router_a": (count, d, rank),
                       "mlp.lora_router_b": (count, rank, cfg.num_experts)}
        out.append(shapes)
    return out


def _place(buf: dict[str, np.ndarray], x: int, module: str, factors: Factors,
           cfg: ModelConfig, rank: int) -> None:
    """Write one module's factors into layer `x` of its segment's buffers (R = `rank`)."""
    a, b = factors
    r, proj = a.shape[-1], module.rpartition(".")[2]
    if proj in ("q_proj", "k_proj", "v_proj"):
        j = ("q_proj", "k_proj", "v_proj").index(proj)
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        col = (0, q, q + kv)[j]
        buf["self_attn.lora_qkv_a"][x, :, j * rank:j * rank + r] = a
        buf["self_attn.lora_qkv_b"][x, j * rank:j * rank + r, col:col + b.shape[-1]] = b
    elif proj == "o_proj":
        buf["self_attn.lora_o_a"][x, :, :r] = a
        buf["self_attn.lora_o_b"][x, :r, :] = b
    elif module == "mlp.gate":  # the router
        buf["mlp.lora_router_a"][x, :, :r] = a
        buf["mlp.lora_router_b"][x, :r, :] = b
    elif proj == "gate_up_proj":  # fused: [gate | up] output columns share the rank
        f = b.shape[-1] // 2
        buf["mlp.lora_gate_up_a"][x, ..., :r] = a
        buf["mlp.lora_gate_up_b"][x, ..., :r, 0, :] = b[..., :f]
        buf["mlp.lora_gate_up_b"][x, ..., :r, 1, :] = b[..., f:]
    elif proj in ("gate_proj", "up_proj"):
        j = 0 if proj == "gate_proj" else 1
        buf["mlp.lora_gate_up_a"][x, ..., j * rank:j * rank + r] = a
        buf["mlp.lora_gate_up_b"][x, ..., j * rank:j * rank + r, j, :] = b
    else:
        buf["mlp.lora_down_a"][x, ..., :r] = a
        buf["mlp.lora_down_b"][x, ..., :r, :] = b


def _check_module(adapter: LoRAAdapter, cfg: ModelConfig, layer: int, module: str,
                  rank: int) -> None:
    lead, d_in, d_out = module_dims(cfg, layer, module)
    a, b = adapter.modules[(layer, module)]
    r = a.shape[-1]
    what = f"adapter {adapter.name!r} model.layers.{layer}.{module}"
    require(a.shape == (*lead, d_in, r) and b.shape == (*lead, r, d_out),
            f"factor shapes of {what}", (list(a.shape), list(b.shape)),
            f"A {[*lead, d_in, r]} and B {[*lead, r, d_out]} for this model")
    limit = 2 * rank if module == GATE_UP else rank
    require(r <= limit, f"rank of {what}", r, f"<= {limit} (buffer rank {rank}"
            + (", doubled for a fused gate_up_proj)" if module == GATE_UP else ")"))


def pack_adapter(adapter: LoRAAdapter, cfg: ModelConfig, *, rank: int,
                 dtype=np.float32) -> list[dict[str, np.ndarray]]:
    """Per segment: buffer name -> `dtype` array of `lora_buffer_shapes(cfg, rank)`, zeros
    where the adapter has no module. Per layer, A @ B of each pair is the summed delta of its
    modules (qkv: out columns [q | k | v]; gate/up: A @ B.reshape(2R, 2F) = [gate | up])."""
    shapes = lora_buffer_shapes(cfg, rank)
    where = {first + x: (s, x) for s, (_, first, count) in enumerate(cfg.segments)
             for x in range(count)}
    out = [{key: np.zeros(shape, dtype) for key, shape in seg.items()} for seg in shapes]
    for layer, module in sorted(adapter.modules):
        _check_module(adapter, cfg, layer, module, rank)
        s, x = where[layer]
        _place(out[s], x, module, adapter.modules[(layer, module)], cfg, rank)
    return out
