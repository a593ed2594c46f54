"""Qwen3 MoE block: fp32 router, top-k, dispatch sorted by expert, grouped matmuls, combine.

No capacity factor and no dropped tokens: every (token, expert) pair is computed, which is
what inference parity with HF requires. Padding tokens are routed to a sentinel group past
the last expert so they never count in the group sizes and cost nothing in the matmuls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from pallas_kernels.grouped_matmul import tuning as gmm_tuning
from pallas_kernels.lora import LoRAGroups
from pallas_kernels.quantized import at, dequantize, merge_pair
from qwen_jax.attention import matmul_op
from qwen_jax.layers import Linear, Runtime, init_param, init_weight, no_quant, stored_weight
from qwen_jax.lora_layers import ExpertLoRA, add_lora, when_active
from qwen_jax.sharding import weight_specs


def route_logits(logits: jax.Array, top_k: int, norm_topk_prob: bool):
    """logits: f32[T, E] -> (weights f32[T, k], expert ids int32[T, k]).

    HF's softmax over all experts, top-k, then renormalisation, without forming the
    softmax: softmax is monotonic, so the top-k of the logits are the top-k experts, and
    its max is the first of them. Renormalised weights are a softmax over the k logits;
    otherwise the denominator sums over all experts. One top-k and one sum."""
    top, ids = jax.lax.top_k(logits, top_k)  # [T, k], descending
    scores = jnp.exp(top - top[:, :1])
    pool = top if norm_topk_prob else logits
    denom = jnp.sum(jnp.exp(pool - top[:, :1]), axis=-1, keepdims=True)
    return scores / denom, ids.astype(jnp.int32)


def route(x: jax.Array, gate: jax.Array, top_k: int, norm_topk_prob: bool):
    """x: [T, D]; gate: [D, E] -> (weights f32[T, k], expert ids int32[T, k])."""
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), gate.astype(jnp.float32))
    return route_logits(logits, top_k, norm_topk_prob)


def dispatch(flat_ids: jax.Array, num_experts: int):
    """flat_ids: int32[M] expert of each (token, slot) pair, `num_experts` for pairs not
    computed here -> (order int32[M], plan). `order` lists the pairs sorted by expert
    (stable; the others last); the plan's group ends are counted without a scatter."""
    order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    ends = jnp.sum(flat_ids[:, None] <= experts[None, :], axis=0, dtype=jnp.int32)  # [E]
    num_rows = flat_ids.shape[0]
    block_m = gmm_tuning.block_m_for(num_rows=num_rows, num_groups=num_experts)
    return order, pallas_kernels.plan_groups(ends, num_rows=num_rows, block_m=block_m)


# Above this many bytes of gathered expert weights the reference path sorts and uses
# ragged_dot instead (which on CPU computes every group densely: E times the work).
# Below it: one weight read per (token, slot) pair for small batches, per block of an
# expert's pairs from 4 pairs per expert on.
GATHER_LIMIT_BYTES = 1 << 26


def experts_gathered(x, ids, gate_up, down, top_k, lora_rows=None):
    """Reference path for small batches: each (token, slot) pair reads its own expert's
    weights. x: [T, D]; ids: int32[T, k] local expert ids; gate_up: [E, D, 2F]; down:
    [E, F, D] (arrays or QuantizedWeights, dequantised per pair) -> [T, k, D].
    lora_rows: the LoRA updates of rows of pairs (`ExpertLoRA.hook`), or None."""
    flat = ids.reshape(-1)  # [M]
    x_pairs = jnp.repeat(x, top_k, axis=0)  # [M, D]
    hi = jax.lax.Precision.HIGHEST
    h = jnp.einsum("md,mdn->mn", x_pairs, dequantize(at(gate_up, flat), x.dtype),
                   precision=hi, preferred_element_type=jnp.float32)  # [M, 2F]
    delta = None if lora_rows is None else lora_rows(jnp.arange(flat.shape[0], dtype=jnp.int32))
    if delta is not None:
        h = h + delta("gate_up", x_pairs)
    ffn = h.shape[-1] // 2
    act = (jax.nn.silu(h[:, :ffn]) * h[:, ffn:]).astype(x.dtype)  # [M, F]
    y = jnp.einsum("mf,mfd->md", act, dequantize(at(down, flat), x.dtype), precision=hi,
                   preferred_element_type=jnp.float32).astype(x.dtype)  # [M, D]
    if delta is not None:
        y = y + delta("down", act)
    return y.reshape(x.shape[0], top_k, -1)


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block of `experts_blocked`: about two blocks per expert, 4..64 rows."""
    return max(4, min(64, num_pairs // (2 * num_experts)))


def experts_blocked(x, ids, gate_up, down, top_k, lora_rows=None):
    """Reference path for mid-size batches: pairs sorted by expert into blocks of B rows
    (a block holds one expert's pairs), one weight read per block, batched matmuls.
    Gathers at most M / B + E experts' weights where `experts_gathered` gathers M.
    x: [T, D]; ids: int32[T, k] local expert ids; gate_up: [E, D, 2F]; down: [E, F, D]
    (arrays or QuantizedWeights) -> [T, k, D]. lora_rows: as `experts_gathered`."""
    flat = ids.reshape(-1)  # [M]
    num_pairs, num_experts = flat.shape[0], gate_up.shape[0]
    rows = block_rows(num_pairs, num_experts)
    num_blocks = num_pairs // rows + num_experts  # sum_e ceil(count_e / B) <= this
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.sum(flat[:, None] == jnp.arange(num_experts)[None, :], axis=0,
                     dtype=jnp.int32)  # [E]
    pair_start = jnp.cumsum(counts) - counts  # first sorted pair of each expert
    blocks = (counts + rows - 1) // rows
    block_end = jnp.cumsum(blocks)  # one past each expert's last block
    block = jnp.arange(num_blocks, dtype=jnp.int32)
    expert = jnp.minimum(jnp.sum(block[:, None] >= block_end[None, :], axis=1,
                                 dtype=jnp.int32), num_experts - 1)  # [nb]
    first = pair_start[expert] + (block - (block_end - blocks)[expert]) * rows
    index = first[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]  # [nb, B]
    real = (index < (pair_start + counts)[expert][:, None]) & (block < block_end[-1])[:, None]
    pair = jnp.where(real, order[jnp.minimum(index, num_pairs - 1)], num_pairs)  # M: none
    xb = x[jnp.minimum(pair, num_pairs - 1) // top_k]  # [nb, B, D]
    hi = jax.lax.Precision.HIGHEST
    h = jnp.einsum("nbd,ndf->nbf", xb, dequantize(at(gate_up, expert), x.dtype),
                   precision=hi, preferred_element_type=jnp.float32)  # [nb, B, 2F]
    delta = None if lora_rows is None else lora_rows(pair.reshape(-1))
    if delta is not None:
        h = h + delta("gate_up", xb.reshape(-1, xb.shape[-1])).reshape(h.shape)
    ffn = h.shape[-1] // 2
    act = (jax.nn.silu(h[..., :ffn]) * h[..., ffn:]).astype(x.dtype)
    y = jnp.einsum("nbf,nfd->nbd", act, dequantize(at(down, expert), x.dtype), precision=hi,
                   preferred_element_type=jnp.float32).astype(x.dtype)  # [nb, B, D]
    if delta is not None:
        y = y + delta("down", act.reshape(-1, ffn)).reshape(y.shape)
    out = jnp.zeros((num_pairs, x.shape[-1]), x.dtype).at[pair.reshape(-1)].set(
        y.reshape(-1, x.shape[-1]), mode="drop")
    return out.reshape(x.shape[0], top_k, -1)


def experts_sorted(x, flat_ids, gate_up, down, layer, *, top_k, gmm, lora_rows=None):
    """Grouped matmuls over the expert-sorted pairs. x: [T, D]; flat_ids: int32[M];
    gate_up: [X, E, D, 2F]; down: [X, E, F, D] (whole stacks, arrays or QuantizedWeights)
    -> [T, k, D].

    The gate/up call reads each pair's token row in place (lhs_rows) and the down call
    stores each result at its pair's (token, slot) row (out_rows): no gathered or
    scattered copies, and one plan for both calls. lora_rows: as `experts_gathered`; its
    updates read and land the same way (rows grouped by (adapter, expert) beside)."""
    num_experts, ffn = gate_up.shape[1], down.shape[-2]
    order, plan = dispatch(flat_ids, num_experts)
    h = gmm(x, gate_up, plan=plan, layer=layer, lhs_rows=order // top_k)  # [M, 2F]
    delta = None if lora_rows is None else lora_rows(order)
    if delta is not None:
        h = h + delta("gate_up", x, lhs_rows=order // top_k)
    act = (jax.nn.silu(h[:, :ffn]) * h[:, ffn:]).astype(x.dtype)           # [M, F]
    y = gmm(act, down, plan=plan, layer=layer, out_rows=order)            # [M, D]
    if delta is not None:
        y = y + delta("down", act, out_rows=order)
    return y.reshape(x.shape[0], top_k, -1)


def moe_local(x, valid, weights, ids, gate_up, down, layer=None, *, first_expert, top_k,
              gmm, gather_ok=False, lora: ExpertLoRA | None = None, lora_op=None):
    """The experts this device holds (first_expert.. + E_local) over all tokens: pairs
    routed elsewhere sort past the local groups and contribute nothing. gate_up
    [X, E_local, D, 2, F], down [X, E_local, F, D]: whole stacks (arrays or
    QuantizedWeights) read at `layer`, or one layer's [E_local, ...] when layer is None.
    lora: the experts' adapters (this device's experts and F-slice) with `lora_op`.
    Returns [T, D]."""
    if layer is None:
        gate_up, down, layer = at(gate_up, None), at(down, None), jnp.zeros((), jnp.int32)
    gate_up = merge_pair(gate_up)                                          # [X, E, D, 2F]
    num_tokens, (_, num_local, dim, width) = x.shape[0], gate_up.shape
    local_ids = ids - first_expert  # [T, k]
    mine = valid[:, None] & (local_ids >= 0) & (local_ids < num_local)
    combine = jnp.where(mine, weights, 0).astype(x.dtype)  # [T, k]
    num_pairs = num_tokens * top_k
    expert_bytes = 3 * dim * width // 2 * x.dtype.itemsize
    blocked = num_pairs >= 4 * num_local  # fewer weight reads than one per pair
    num_reads = num_pairs // block_rows(num_pairs, num_local) + num_local if blocked \
        else num_pairs
    flat = jnp.where(mine, local_ids, num_local).reshape(-1)  # [M]
    lora_rows = None if lora is None else lora.hook(flat, top_k, layer, lora_op)
    if gather_ok and num_reads * expert_bytes <= GATHER_LIMIT_BYTES:
        experts = experts_blocked if blocked else experts_gathered
        y = experts(x, jnp.where(mine, local_ids, 0), at(gate_up, layer), at(down, layer),
                    top_k, lora_rows)
    else:
        y = experts_sorted(x, flat, gate_up, down, layer, top_k=top_k, gmm=gmm,
                           lora_rows=lora_rows)
    # The weighted sum over the k slots, accumulated in fp32 like a dot.
    out = jnp.sum(y.astype(jnp.float32) * combine.astype(jnp.float32)[..., None], axis=1)
    return out.astype(x.dtype)


def _experts_quant(quant, num_experts, projections):
    """One format for the experts' stacked projections, if every one of them is quantised."""
    formats = {quant(f"mlp.experts.{e}.{p}") for e in range(num_experts) for p in projections}
    return formats.pop() if len(formats) == 1 else None


class SparseMoE(nnx.Module):
    """HF `mlp` of an MoE layer. gate <- mlp.gate.weight.T;
    gate_up_proj[e] <- stack(experts.e.gate_proj.weight.T, experts.e.up_proj.weight.T)
    as [D, 2, F] (gate and up stay whole under an F-sharded tensor-parallel split);
    down_proj[e] <- experts.e.down_proj.weight.T. Quantised experts keep their scales
    beside them (gate_up_proj_scale, ...; see layers.init_weight); the router never is."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32, rngs=None, quant=no_quant):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.gate = init_param(rngs, (*stack, d, e), dtype)  # [D, E]
        self.gate_up_quant = _experts_quant(quant, e, ("gate_proj", "up_proj"))
        self.down_quant = _experts_quant(quant, e, ("down_proj",))
        init_weight(self, "gate_up_proj", rngs, (*stack, e, d, 2, f), dtype,
                    self.gate_up_quant, pair=True)                          # [E, D, 2, F]
        init_weight(self, "down_proj", rngs, (*stack, e, f, d), dtype, self.down_quant)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: jax.Array, valid: jax.Array, rt: Runtime, layer,
                 lora: LoRAGroups | None = None) -> jax.Array:
        """x: [T, D]; valid: bool[T]; layer: int32[] index into the stacks -> [T, D].
        lora: the tokens' adapter groups (qwen_jax/lora_layers.py), or None."""
        logits = matmul_op(rt)(x, (self.gate[...],), layer, out_dtype=jnp.float32)
        logits = add_lora(logits, x, self, "lora_router", layer, lora, rt, xla=True)  # f32
        weights, ids = route_logits(logits, self.top_k, self.norm_topk_prob)  # [T, k]
        gmm = rt.kernels.grouped_matmul
        gate_up = stored_weight(self, "gate_up_proj", self.gate_up_quant, pair=True)
        down = stored_weight(self, "down_proj", self.down_quant)
        gather_ok = rt.impl == "reference"
        adapters = ExpertLoRA.of(self, lora)
        local = functools.partial(moe_local, top_k=self.top_k, gmm=gmm, gather_ok=gather_ok,
                                  lora_op=rt.kernels.lora_matmul)
        if rt.mesh is None:
            def run(adapters):
                return local(x, valid, weights, ids, gate_up, down, layer, first_expert=0,
                             lora=adapters)
            if adapters is None or lora is None:
                return run(None)
            return when_active(lora, rt, lambda: run(adapters), lambda: run(None))

        def sharded(x, valid, weights, ids, gate_up, down, layer, adapters):
            # Tokens arrive replicated; each device runs its experts' F-slice and the
            # combine is one psum over both axes (experts and F partial sums; the LoRA
            # updates are linear in them too).
            first = jax.lax.axis_index("expert") * gate_up.shape[1]
            y = local(x, valid, weights, ids, gate_up, down, layer, first_expert=first,
                      lora=adapters)
            return jax.lax.psum(y, ("expert", "model"))

        rep = P()
        adapter_specs = None if adapters is None else adapters.specs("expert", "model")
        return jax.shard_map(
            sharded, mesh=rt.mesh,
            in_specs=(rep, rep, rep, rep,
                      weight_specs(gate_up, P(None, "expert", None, None, "model")),
                      weight_specs(down, P(None, "expert", "model", None)), rep,
                      adapter_specs),
            out_specs=rep, check_vma=False)(x, valid, weights, ids, gate_up, down, layer,
                                            adapters)


class MLP(nnx.Module):
    """HF dense `mlp`: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32, rngs=None, quant=no_quant):
        d, f = cfg.hidden_size, cfg.intermediate_size
        linear = lambda name, i, o: Linear(i, o, stack=stack, dtype=dtype, rngs=rngs,
                                           quant=quant(f"mlp.{name}"))
        self.gate_proj = linear("gate_proj", d, f)
        self.up_proj = linear("up_proj", d, f)
        self.down_proj = linear("down_proj", f, d)

    def __call__(self, x: jax.Array, valid: jax.Array, rt: Runtime, layer=None,
                 lora: LoRAGroups | None = None) -> jax.Array:
        """x: [T, D] -> [T, D]; with `layer`, the params are stacked and read in place.
        lora: the tokens' adapter groups (qwen_jax/lora_layers.py)."""
        del valid
        if layer is None:  # per-layer view (sliced params)
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
        matmul = matmul_op(rt)
        ffn = self.gate_proj.kernel.shape[-1]
        h = matmul(x, (self.gate_proj.weight(), self.up_proj.weight()), layer)  # [T, 2F]
        h = add_lora(h, x, self, "lora_gate_up", layer, lora, rt)
        act = jax.nn.silu(h[:, :ffn]) * h[:, ffn:]
        return add_lora(matmul(act, (self.down_proj.weight(),), layer), act, self, "lora_down",
                        layer, lora, rt)
