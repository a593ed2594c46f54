"""Qwen3 MoE block: fp32 router, top-k, dispatch sorted by expert, grouped matmuls, combine.

No capacity factor and no dropped tokens: every (token, expert) pair is computed, which is
what inference parity with HF requires. Padding tokens are routed to a sentinel group past
the last expert so they never count in `group_sizes` and cost nothing in the matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import grouped_matmul_reference
from qwen_jax.layers import Linear, init_param


def grouped_matmul_op(impl: str):
    if impl == "pallas":
        from pallas_kernels.grouped_matmul import grouped_matmul
        return grouped_matmul
    if impl != "reference":
        raise ValueError(f"impl must be 'pallas' or 'reference', got {impl!r}")
    return grouped_matmul_reference


def route(x: jax.Array, gate: jax.Array, top_k: int, norm_topk_prob: bool):
    """x: [T, D]; gate: [D, E] -> (weights f32[T, k], expert ids int32[T, k])."""
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), gate.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)  # [T, E] over all experts
    weights, ids = jax.lax.top_k(probs, top_k)  # [T, k]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def dispatch(ids: jax.Array, valid: jax.Array, num_experts: int):
    """ids: int32[T, k]; valid: bool[T] -> (order int32[T*k], group_sizes int32[E]).

    `order` lists the (token, slot) pairs sorted by expert; padding pairs sort last.
    """
    flat = jnp.where(valid[:, None], ids, num_experts).reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
    return order, group_sizes


def experts_forward(x_sorted, gate_up, down, group_sizes, impl: str):
    """x_sorted: [M, D]; gate_up: [E, D, 2F]; down: [E, F, D] -> [M, D]."""
    gmm = grouped_matmul_op(impl)
    h = gmm(x_sorted, gate_up, group_sizes)  # [M, 2F]
    ffn = gate_up.shape[-1] // 2
    act = jax.nn.silu(h[:, :ffn]) * h[:, ffn:]  # [M, F]
    return gmm(act.astype(x_sorted.dtype), down, group_sizes)  # [M, D]


class SparseMoE(nnx.Module):
    """HF `mlp` of an MoE layer. gate <- mlp.gate.weight.T;
    gate_up_proj[e] <- concat(experts.e.gate_proj.weight.T, experts.e.up_proj.weight.T);
    down_proj[e] <- experts.e.down_proj.weight.T."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32, rngs=None):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.gate = init_param(rngs, (*stack, d, e), dtype)  # [D, E]
        self.gate_up_proj = init_param(rngs, (*stack, e, d, 2 * f), dtype)  # [E, D, 2F]
        self.down_proj = init_param(rngs, (*stack, e, f, d), dtype)  # [E, F, D]
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: jax.Array, valid: jax.Array, impl: str) -> jax.Array:
        """x: [T, D]; valid: bool[T] -> [T, D]."""
        num_tokens, num_experts = x.shape[0], self.gate.shape[-1]
        weights, ids = route(x, self.gate[...], self.top_k, self.norm_topk_prob)  # [T, k]
        order, group_sizes = dispatch(ids, valid, num_experts)
        x_sorted = x[order // self.top_k]  # [T*k, D]
        y_sorted = experts_forward(x_sorted, self.gate_up_proj[...], self.down_proj[...],
                                   group_sizes, impl)  # [T*k, D]
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)  # [T*k, D] in (token, slot) order
        y = y.reshape(num_tokens, self.top_k, -1)  # [T, k, D]
        return jnp.einsum("tkd,tk->td", y, weights.astype(x.dtype))


class MLP(nnx.Module):
    """HF dense `mlp`: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32, rngs=None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, stack=stack, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, stack=stack, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, stack=stack, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, valid: jax.Array, impl: str) -> jax.Array:
        del valid, impl
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
