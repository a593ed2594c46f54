"""Qwen3 attention over the paged KV cache: q/k RMSNorm before RoPE, GQA.

The cache of a segment of X stacked layers is one array per K and V of shape
[X * P, L, K, H]: layer x owns pages [x * P, (x + 1) * P). Offsetting the page table
and slot mapping by x * P lets every layer hand its pages to the attention op without
slicing (and so copying) the cache inside the layer scan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

import pallas_kernels
from qwen_jax.layers import Linear, RMSNorm, Runtime, apply_rope
from qwen_jax.sharding import kv_replication


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each flattened token sits in the paged cache (see serving/batch.py); host
    numpy arrays until the step moves them to the devices."""

    slot_mapping: Int[Array | np.ndarray, " T"]  # flat slot (page * L + offset); pad -> page 0
    query_start: Int[Array | np.ndarray, " S+1"]
    kv_lens: Int[Array | np.ndarray, " S"]  # context length including this step's tokens
    page_table: Int[Array | np.ndarray, "S pages_per_seq"]
    num_seqs: Int[Array | np.ndarray, ""]  # real sequences; the rest is padding

    def valid_tokens(self, num_tokens: int) -> jax.Array:
        """bool[T]: real tokens (rows before query_start[num_seqs])."""
        end = self.query_start[jnp.clip(self.num_seqs, 0, self.kv_lens.shape[0])]
        return jnp.arange(num_tokens, dtype=jnp.int32) < end


def paged_attention(q, k, v, kv_cache, meta: AttentionMetadata, page_offset, sm_scale,
                    rt: Runtime):
    """Write this step's K/V into the layer's pages, then attend. q: [T, N, H]; k, v:
    [T, K', H] with K' the cache's heads. Under a mesh each device does its own heads."""
    ops = pallas_kernels.ops(rt.impl)

    def local(q, k, v, k_cache, v_cache, slots, page_table, kv_lens, query_start, num_seqs):
        k_cache, v_cache = ops.write_kv_pages(k_cache, v_cache, k, v, slots)
        out = ops.ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_table, query_start,
                                         num_seqs, sm_scale=sm_scale)
        return out, k_cache, v_cache

    page_size = kv_cache[0].shape[1]
    args = (q, k, v, *kv_cache, meta.slot_mapping + page_offset * page_size,
            meta.page_table + page_offset, meta.kv_lens, meta.query_start, meta.num_seqs)
    if rt.mesh is None:
        out, k_cache, v_cache = local(*args)
    else:
        heads, cache, rep = P(None, "model", None), P(None, None, "model", None), P()
        out, k_cache, v_cache = jax.shard_map(
            local, mesh=rt.mesh, in_specs=(heads, heads, heads, cache, cache) + (rep,) * 5,
            out_specs=(heads, cache, cache), check_vma=False)(*args)
    return out, (k_cache, v_cache)


class Attention(nnx.Module):
    """HF `self_attn`: q/k/v/o projections (optional bias), per-head q_norm/k_norm."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32, rngs=None):
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(d, n * h, use_bias=bias, stack=stack, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, k * h, use_bias=bias, stack=stack, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, k * h, use_bias=bias, stack=stack, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(n * h, d, use_bias=bias, stack=stack, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h

    def __call__(self, x, positions, kv_cache, meta: AttentionMetadata, page_offset, rope,
                 rt: Runtime):
        """x: [T, D]; positions: int32[T]; kv_cache: ([P', L, K, H], [P', L, K, H]).

        page_offset: int32[] first page of this layer in the segment's cache.
        rope: (inv_freq [H/2], scale). Returns ([T, D], updated kv_cache).
        """
        num_tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, K, H]
        q = apply_rope(q, positions, *rope)  # [T, N, H]
        k = apply_rope(k, positions, *rope)  # [T, K, H]
        copies = kv_replication(self.num_kv_heads, rt.mesh)
        if copies > 1:  # TP > K: each device keeps a copy of the KV head it reads
            k, v = jnp.repeat(k, copies, axis=1), jnp.repeat(v, copies, axis=1)  # [T, TP, H]
        out, kv_cache = paged_attention(q, k, v, kv_cache, meta, page_offset,
                                        self.head_dim ** -0.5, rt)  # [T, N, H]
        return self.o_proj(out.reshape(num_tokens, -1)), kv_cache
