"""Qwen3 MoE block: fp32 router, top-k, dispatch sorted by expert, grouped matmuls, combine.

No capacity factor and no dropped tokens: every (token, expert) pair is computed, which is
what inference parity with HF requires. Padding tokens are routed to a sentinel group past
the last expert so they never count in `group_sizes` and cost nothing in the matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from qwen_jax.layers import Linear, Runtime, init_param


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


def experts_forward(x_sorted, gate_up, down, group_sizes, gmm):
    """x_sorted: [M, D]; gate_up: [E, D, 2, F]; down: [E, F, D] -> [M, D]."""
    num_experts, dim, _, ffn = gate_up.shape
    h = gmm(x_sorted, gate_up.reshape(num_experts, dim, 2 * ffn), group_sizes)  # [M, 2F]
    act = jax.nn.silu(h[:, :ffn]) * h[:, ffn:]  # [M, F]
    return gmm(act.astype(x_sorted.dtype), down, group_sizes)  # [M, D]


# Above this many bytes of gathered expert weights the reference path sorts and uses
# ragged_dot instead (which on CPU computes every group densely: E times the work).
GATHER_LIMIT_BYTES = 1 << 26


def experts_gathered(x, ids, gate_up, down, top_k):
    """Reference path for small batches: each (token, slot) pair reads its own expert's
    weights. x: [T, D]; ids: int32[T, k] local expert ids -> [T, k, D]."""
    flat = ids.reshape(-1)  # [M]
    x_pairs = jnp.repeat(x, top_k, axis=0)  # [M, D]
    hi = jax.lax.Precision.HIGHEST
    h = jnp.einsum("md,mdgf->mgf", x_pairs, gate_up[flat], precision=hi,
                   preferred_element_type=jnp.float32)  # [M, 2, F]
    act = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x.dtype)  # [M, F]
    y = jnp.einsum("mf,mfd->md", act, down[flat], precision=hi,
                   preferred_element_type=jnp.float32).astype(x.dtype)  # [M, D]
    return y.reshape(x.shape[0], top_k, -1)


def moe_local(x, valid, weights, ids, gate_up, down, *, first_expert, top_k, gmm,
              gather_ok=False):
    """The experts this device holds (first_expert.. + E_local) over all tokens: pairs
    routed elsewhere sort past the local groups and contribute nothing. Returns [T, D]."""
    num_tokens, num_local = x.shape[0], gate_up.shape[0]
    local_ids = ids - first_expert  # [T, k]
    mine = valid[:, None] & (local_ids >= 0) & (local_ids < num_local)
    combine = jnp.where(mine, weights, 0).astype(x.dtype)  # [T, k]
    pair_bytes = num_tokens * top_k * (gate_up[0].size + down[0].size) * gate_up.dtype.itemsize
    if gather_ok and pair_bytes <= GATHER_LIMIT_BYTES:
        y = experts_gathered(x, jnp.where(mine, local_ids, 0), gate_up, down, top_k)
        return jnp.einsum("tkd,tk->td", y, combine)
    order, group_sizes = dispatch(jnp.where(mine, local_ids, num_local), valid, num_local)
    x_sorted = x[order // top_k]  # [T*k, D]
    y_sorted = experts_forward(x_sorted, gate_up, down, group_sizes, gmm)  # [T*k, D]
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)  # (token, slot) order
    y = y.reshape(num_tokens, top_k, -1)  # [T, k, D]
    return jnp.einsum("tkd,tk->td", y, combine)


class SparseMoE(nnx.Module):
    """HF `mlp` of an MoE layer. gate <- mlp.gate.weight.T;
    gate_up_proj[e] <- stack(experts.e.gate_proj.weight.T, experts.e.up_proj.weight.T)
    as [D, 2, F] (gate and up stay whole under an F-sharded tensor-parallel split);
    down_proj[e] <- experts.e.down_proj.weight.T."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32, rngs=None):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.gate = init_param(rngs, (*stack, d, e), dtype)  # [D, E]
        self.gate_up_proj = init_param(rngs, (*stack, e, d, 2, f), dtype)  # [E, D, 2, F]
        self.down_proj = init_param(rngs, (*stack, e, f, d), dtype)  # [E, F, D]
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: jax.Array, valid: jax.Array, rt: Runtime) -> jax.Array:
        """x: [T, D]; valid: bool[T] -> [T, D]."""
        weights, ids = route(x, self.gate[...], self.top_k, self.norm_topk_prob)  # [T, k]
        gmm = pallas_kernels.ops(rt.impl).grouped_matmul
        gate_up, down = self.gate_up_proj[...], self.down_proj[...]
        gather_ok = rt.impl == "reference"
        if rt.mesh is None:
            return moe_local(x, valid, weights, ids, gate_up, down, first_expert=0,
                             top_k=self.top_k, gmm=gmm, gather_ok=gather_ok)

        def sharded(x, valid, weights, ids, gate_up, down):
            # Tokens arrive replicated; each device runs its experts' F-slice and the
            # combine is one psum over both axes (experts and F partial sums).
            first = jax.lax.axis_index("expert") * gate_up.shape[0]
            y = moe_local(x, valid, weights, ids, gate_up, down, first_expert=first,
                          top_k=self.top_k, gmm=gmm, gather_ok=gather_ok)
            return jax.lax.psum(y, ("expert", "model"))

        rep = P()
        return jax.shard_map(
            sharded, mesh=rt.mesh,
            in_specs=(rep, rep, rep, rep, P("expert", None, None, "model"),
                      P("expert", "model", None)),
            out_specs=rep, check_vma=False)(x, valid, weights, ids, gate_up, down)


class MLP(nnx.Module):
    """HF dense `mlp`: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32, rngs=None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, stack=stack, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, stack=stack, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, stack=stack, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, valid: jax.Array, rt: Runtime) -> jax.Array:
        del valid, rt
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
