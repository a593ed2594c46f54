"""Qwen3 attention over the paged KV cache: q/k RMSNorm before RoPE, GQA.

The cache of a segment of X stacked layers is one array per K and V of shape
[X * P, L, K, H]: layer x owns pages [x * P, (x + 1) * P). Offsetting the page table
and slot mapping by x * P lets every layer hand its pages to the attention op without
slicing (and so copying) the cache inside the layer scan. The projections read the
layer's weights in place the same way: whole stacks and a layer index.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from pallas_kernels.array_types import Array, Int
from qwen_jax.layers import Linear, RMSNorm, Runtime, no_quant, rms_normalize, rope_tables, rotate
from qwen_jax.lora_layers import add_lora, token_groups
from qwen_jax.sharding import kv_replication

# KV page dtypes stored quantised; they are read and written with per-kv-head scales.
QUANTIZED_KV_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each flattened token sits in the paged cache (see
    serving/executor/model_inputs.py); host numpy arrays until the step moves them to the
    devices."""

    slot_mapping: Int[Array | np.ndarray, " T"]  # flat slot (page * L + offset); pad -> page 0
    query_start: Int[Array | np.ndarray, " S+1"]
    kv_lens: Int[Array | np.ndarray, " S"]  # context length including this step's tokens
    page_table: Int[Array | np.ndarray, "S pages_per_seq"]
    num_seqs: Int[Array | np.ndarray, ""]  # real sequences; the rest is padding

    def valid_tokens(self, num_tokens: int) -> jax.Array:
        """bool[T]: real tokens (rows before query_start[num_seqs])."""
        end = self.query_start[jnp.clip(self.num_seqs, 0, self.kv_lens.shape[0])]
        return jnp.arange(num_tokens, dtype=jnp.int32) < end


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every layer of a step shares, computed once before the layer scans."""

    meta: AttentionMetadata
    plan: Any             # the attention op's work plan (ops.plan_attention)
    cos: jax.Array        # [T, 1, H] RoPE tables in the model dtype
    sin: jax.Array
    valid: jax.Array      # bool[T] real tokens
    lora: Any = None      # LoRAGroups of the tokens by adapter slot; None: no LoRA


def step_context(meta: AttentionMetadata, positions, rope, *, dtype, num_q_heads,
                 num_kv_heads, head_dim, rt: Runtime, lora_slots=None,
                 num_lora_slots: int = 0) -> StepContext:
    """rope: (inv_freq [H/2], scale). num_kv_heads: the cache's heads (K').
    lora_slots: int32[T] each token's adapter slot (0: none), with `num_lora_slots`
    buffers; None (or no buffers): no LoRA in this step."""
    num_tokens = positions.shape[0]
    plan = rt.kernels.plan_attention(
        meta.query_start, meta.kv_lens, meta.num_seqs, num_tokens=num_tokens,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    inv_freq, scale = rope
    cos, sin = rope_tables(positions, inv_freq, scale, dtype)
    valid = meta.valid_tokens(num_tokens)
    lora = (None if lora_slots is None or not num_lora_slots
            else token_groups(lora_slots, valid, num_lora_slots))
    return StepContext(meta=meta, plan=plan, cos=cos, sin=sin, valid=valid, lora=lora)


def matmul_op(rt: Runtime):
    """The stacked matmul: the Pallas kernel on one device; under a mesh the reference
    (XLA dots, which SPMD partitions over the sharded weights; a custom call would make
    XLA gather the weights onto every device)."""
    if rt.mesh is not None:
        return pallas_kernels.stacked_matmul_reference
    return rt.kernels.stacked_matmul


def kv_scales(pages) -> jax.Array | None:
    """Unit per-kv-head scales for quantised pages (no calibration: vLLM's default)."""
    if pages.dtype not in QUANTIZED_KV_DTYPES:
        return None
    return jnp.ones((pages.shape[2],), jnp.float32)


def paged_attention(q, k, v, kv_cache, ctx: StepContext, page_offset, sm_scale, rt: Runtime):
    """Write this step's K/V into the layer's pages, then attend. q: [T, N, H]; k, v:
    [T, K', H] with K' the cache's heads. Under a mesh each device does its own heads."""
    ops = rt.kernels

    def local(q, k, v, k_cache, v_cache, slots, page_table, kv_lens, query_start, num_seqs,
              plan):
        scale = kv_scales(k_cache)
        k_cache, v_cache = ops.write_kv_pages(k_cache, v_cache, k, v, slots, k_scale=scale,
                                              v_scale=scale)
        out = ops.ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_table, query_start,
                                         num_seqs, sm_scale=sm_scale, k_scale=scale,
                                         v_scale=scale, plan=plan)
        return out, k_cache, v_cache

    meta = ctx.meta
    page_size = kv_cache[0].shape[1]
    args = (q, k, v, *kv_cache, meta.slot_mapping + page_offset * page_size,
            meta.page_table + page_offset, meta.kv_lens, meta.query_start, meta.num_seqs,
            ctx.plan)
    if rt.mesh is None:
        out, k_cache, v_cache = local(*args)
    else:
        heads, cache, rep = P(None, "model", None), P(None, None, "model", None), P()
        out, k_cache, v_cache = jax.shard_map(
            local, mesh=rt.mesh, in_specs=(heads, heads, heads, cache, cache) + (rep,) * 6,
            out_specs=(heads, cache, cache), check_vma=False)(*args)
    return out, (k_cache, v_cache)


class Attention(nnx.Module):
    """HF `self_attn`: q/k/v/o projections (optional bias), per-head q_norm/k_norm."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32, rngs=None, quant=no_quant):
        """quant(name) -> the WeightFormat of sub-module `name` (None: unquantised)."""
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        linear = lambda name, i, o: Linear(i, o, use_bias=cfg.attention_bias, stack=stack,
                                           dtype=dtype, rngs=rngs, quant=quant(f"self_attn.{name}"))
        self.q_proj = linear("q_proj", d, n * h)
        self.k_proj = linear("k_proj", d, k * h)
        self.v_proj = linear("v_proj", d, k * h)
        self.o_proj = linear("o_proj", n * h, d)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h

    def __call__(self, x, kv_cache, ctx: StepContext, layer, page_offset, rt: Runtime):
        """x: [T, D]; kv_cache: ([P', L, K', H], [P', L, K', H]); layer: int32[] index into
        the stacked projections (norm weights and biases arrive sliced);
        page_offset: int32[] first page of this layer in the segment's cache.
        Returns ([T, D], updated kv_cache)."""
        num_tokens = x.shape[0]
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        projs = (self.q_proj, self.k_proj, self.v_proj)
        qkv = matmul_op(rt)(x, tuple(p.weight() for p in projs), layer)   # [T, (N+2K)H]
        qkv = add_lora(qkv, x, self, "lora_qkv", layer, ctx.lora, rt)
        if self.q_proj.bias is not None:
            qkv = qkv + jnp.concatenate([p.bias[...] for p in projs])
        # q_norm and k_norm in one pass: each head is normalised over H on its own.
        qk = qkv[:, :(n + k) * h].reshape(num_tokens, n + k, h)            # [T, N+K, H]
        norm_weight = jnp.concatenate([
            jnp.broadcast_to(self.q_norm.weight[...], (n, h)),
            jnp.broadcast_to(self.k_norm.weight[...], (k, h))])            # [N+K, H]
        qk = rotate(norm_weight * rms_normalize(qk, self.q_norm.eps), ctx.cos, ctx.sin)
        q, k_new = qk[:, :n], qk[:, n:]                                    # [T, N|K, H]
        v = qkv[:, (n + k) * h:].reshape(num_tokens, k, h)                 # [T, K, H]
        copies = kv_replication(k, rt.mesh)
        if copies > 1:  # TP > K: each device keeps a copy of the KV head it reads
            k_new, v = jnp.repeat(k_new, copies, axis=1), jnp.repeat(v, copies, axis=1)
        out, kv_cache = paged_attention(q, k_new, v, kv_cache, ctx, page_offset, h ** -0.5,
                                        rt)                                # [T, N, H]
        out = out.reshape(num_tokens, n * h)
        out = add_lora(matmul_op(rt)(out, (self.o_proj.weight(),), layer), out, self,
                       "lora_o", layer, ctx.lora, rt)
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias[...]
        return out, kv_cache
