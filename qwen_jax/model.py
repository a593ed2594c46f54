"""The Qwen3 / Qwen3-MoE decoder: embeddings, scanned layer segments, final norm, lm head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

import pallas_kernels
from pallas_kernels.array_types import Array, Float, Int
from qwen_jax import lora_layers, sharding, weights
from qwen_jax.attention import Attention, AttentionMetadata, StepContext, step_context
from qwen_jax.config import ModelConfig
from qwen_jax.layers import RMSNorm, Runtime, init_param, no_quant
from qwen_jax.moe import MLP, SparseMoE
from qwen_jax.quantization import Quantization

KVCache = list  # per segment: (k [X*P, L, K', H], v [X*P, L, K', H]); K' = K * replication


class DecoderLayer(nnx.Module):
    """HF `model.layers.{i}`; built with `stack=(X,)` to hold X layers' params stacked."""

    def __init__(self, cfg: ModelConfig, kind: str, *, stack=(), dtype=jnp.float32, rngs=None,
                 layers: range = range(0)):
        """layers: the HF layer indices held (their quantisation decides the formats)."""
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        quant = layer_quant(cfg.quantization, layers)
        self.self_attn = Attention(cfg, stack=stack, dtype=dtype, rngs=rngs, quant=quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack,
                                                dtype=dtype)
        mlp_cls = SparseMoE if kind == "moe" else MLP
        self.mlp = mlp_cls(cfg, stack=stack, dtype=dtype, rngs=rngs, quant=quant)

    def __call__(self, x, kv_cache, ctx: StepContext, layer, page_offset, rt):
        """Layer `layer` of the stack: matrices whole, vectors already sliced."""
        attn_out, kv_cache = self.self_attn(self.input_layernorm(x), kv_cache, ctx, layer,
                                            page_offset, rt)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x), ctx.valid, rt, layer, lora=ctx.lora)
        return x, kv_cache


def layer_quant(quantization: Quantization | None, layers: range):
    """quant(name) -> the WeightFormat of sub-module `name` (e.g. "self_attn.q_proj") over
    `layers`: quantised only if the checkpoint quantises it in every one of them."""
    if quantization is None:
        return no_quant
    return lambda name: quantization.format_for([f"model.layers.{i}.{name}" for i in layers])


def layer_vectors(state):
    """Per-layer vector params ([X, n] stacks: norm weights, biases) gathered into one
    [X, sum n] table per dtype, built once per step, and a function that returns the
    state with the matrices whole and the vectors of one layer: one dynamic slice per
    layer instead of one per vector."""
    leaves, treedef = jax.tree.flatten(state)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        if leaf.ndim == 2:
            groups.setdefault(jnp.dtype(leaf.dtype), []).append(i)
    tables = {dtype: jnp.concatenate([leaves[i] for i in ids], axis=1)
              for dtype, ids in groups.items()}

    def at(layer):
        out = list(leaves)
        for dtype, ids in groups.items():
            row = tables[dtype][layer]  # [sum n]
            offsets = np.cumsum([0] + [leaves[i].shape[1] for i in ids])
            for i, start, stop in zip(ids, offsets[:-1], offsets[1:]):
                out[i] = row[start:stop]
        return jax.tree.unflatten(treedef, out)

    return at


def run_segment(stack: DecoderLayer, x, kv_cache, ctx: StepContext, rt, capture=None):
    """Scan the stacked layers of one segment over a layer index; the weights stay whole
    (read in place by the ops) and the cache rides in the carry (updated in place).
    capture: (slots int32[X], buffer [n + 1, T, D]): the hidden state entering local layer
    x is written to buffer[slots[x]] (slot n: not kept); returns the buffer as a third."""
    graphdef, state = nnx.split(stack)
    num_layers = jax.tree.leaves(state)[0].shape[0]
    pages_per_layer = kv_cache[0].shape[0] // num_layers
    layer_state = layer_vectors(state)
    slots = None if capture is None else capture[0]

    def body(carry, _):
        h, kv, layer, kept = carry  # the index rides in the carry: no per-layer iota slice
        if slots is not None:
            kept = jax.lax.dynamic_update_index_in_dim(kept, h, slots[layer], 0)
        module = nnx.merge(graphdef, layer_state(layer))
        h, kv = module(h, kv, ctx, layer, layer * pages_per_layer, rt)
        return (h, kv, layer + 1, kept), None

    kept = None if capture is None else capture[1]
    init = (x, kv_cache, jnp.zeros((), jnp.int32), kept)
    (x, kv_cache, _, kept), _ = jax.lax.scan(body, init, length=num_layers)
    return (x, kv_cache) if capture is None else (x, kv_cache, kept)


def run_segment_staged(stack: DecoderLayer, x, kv_cache, ctx: StepContext, rt):
    """`run_segment` over pipeline stages (the mesh's `stage` axis): each stage holds
    X / PP of the segment's layers and their KV pages, and the stages take turns: in turn
    r stage r runs its layers on the hidden states stage r - 1 passed it, then every stage
    hands its hidden states to the next (ppermute). After PP turns the last stage's output
    sits on stage 0, and one psum gives it to every stage.

    Every stage computes in every turn (a collective inside a branch only some devices
    take would stall the others'); out of its turn a stage writes its K/V to the padding
    scratch page (slot 0 of each layer's pages) and its output is dropped, so each page
    is written once, by its stage's turn. The stages' other axes (expert, model) stay
    automatic: the layers' own shard_maps run inside on the context mesh."""
    mesh = rt.mesh
    pp = mesh.shape["stage"]
    graphdef, state = nnx.split(stack)
    shift = [(i, (i + 1) % pp) for i in range(pp)]

    def staged(state, kv, x, ctx):
        stage = jax.lax.axis_index("stage")
        local = nnx.merge(graphdef, state)
        inner = dataclasses.replace(rt, mesh=jax.sharding.get_abstract_mesh())
        slots = ctx.meta.slot_mapping

        def turn(r, carry):
            h, kv = carry
            mine = stage == r
            meta = dataclasses.replace(ctx.meta, slot_mapping=jnp.where(mine, slots, 0))
            out, kv = run_segment(local, h, kv, dataclasses.replace(ctx, meta=meta), inner)
            return jax.lax.ppermute(jnp.where(mine, out, h), "stage", shift), kv

        h, kv = jax.lax.fori_loop(0, pp, turn, (x, kv))
        return jax.lax.psum(jnp.where(stage == 0, h, jnp.zeros_like(h)), "stage"), kv

    stage_split, rep = PartitionSpec("stage"), PartitionSpec()
    return jax.shard_map(staged, mesh=mesh, in_specs=(stage_split, stage_split, rep, rep),
                         out_specs=(rep, stage_split), axis_names={"stage"},
                         check_vma=False)(state, kv_cache, x, ctx)


class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 (dense) and Qwen3-MoE causal LM. HF names: embed_tokens <- model.embed_tokens,
    segments[s] <- model.layers[first:first+count], norm <- model.norm, lm_head <- lm_head."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 impl: str | None = None, mesh=None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.runtime = Runtime(impl or pallas_kernels.default_impl(), mesh)
        self.embed_tokens = init_param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)  # [V, D]
        self.segments = nnx.List([
            DecoderLayer(cfg, kind, stack=(count,), dtype=dtype, rngs=rngs,
                         layers=range(first, first + count))
            for kind, first, count in cfg.segments])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else init_param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype))  # [D, V]
        inv_freq, scale = cfg.rope_inv_freq_and_scale
        self.rope_scale = float(scale)
        self.rope_inv_freq = nnx.Variable(jnp.asarray(inv_freq))  # buffer, not a Param
        # Layers whose input hidden states the step keeps for an EAGLE-3 head (set by the
        # engine before its caches are built), in the KV caches' last entry, by slot.
        self.aux_layers: tuple[int, ...] = ()
        # LoRA adapter buffers (qwen_jax/lora_layers.py): none until `enable_lora`.
        self.lora_slots, self.lora_rank = 0, 0

    @property
    def dtype(self):
        return self.embed_tokens.dtype

    # ---- serving path ------------------------------------------------------------------
    def forward(self, token_ids: Int[Array | np.ndarray, " T"],
                positions: Int[Array | np.ndarray, " T"],
                kv_caches: KVCache, meta: AttentionMetadata,
                lora_slots: Int[Array | np.ndarray, " T"] | None = None
                ) -> tuple[Float[Array, "T D"], KVCache]:
        """token_ids, positions: int32[T] -> (final hidden [T, D], updated caches).
        lora_slots: int32[T] each token's adapter slot (0: none; see `enable_lora`)."""
        x = self.embed_tokens[...][token_ids]  # [T, D]
        ctx = self.step_context(meta, positions, lora_slots)
        if self.aux_layers:
            if sharding.pp_size(self.mesh) > 1:
                raise ValueError("an EAGLE-3 head's hidden states are not kept across "
                                 "pipeline stages: use pipeline_parallel_size=1 with eagle3")
            x, new_caches, aux = self._forward_capturing(x, kv_caches, ctx)
            flat = kv_caches[-1][0].reshape(-1, aux.shape[-1])  # [P * L, A]
            aux_cache = flat.at[meta.slot_mapping].set(aux.astype(flat.dtype))
            return self.norm(x), [*new_caches, (aux_cache.reshape(kv_caches[-1][0].shape),)]
        new_caches = []
        run = run_segment_staged if sharding.pp_size(self.mesh) > 1 else run_segment
        for stack, kv in zip(self.segments, kv_caches):
            x, kv = run(stack, x, kv, ctx, self.runtime)
            new_caches.append(kv)
        return self.norm(x), new_caches

    def step_context(self, meta: AttentionMetadata, positions, lora_slots=None,
                     rt: Runtime | None = None) -> StepContext:
        """What every layer of a step over `positions` shares (RoPE tables, the attention
        plan, the tokens grouped by LoRA adapter). rt: the runtime to plan with (default
        the model's; a stage's inside the pipeline's shard_map)."""
        cfg = self.config
        return step_context(meta, positions, (self.rope_inv_freq[...], self.rope_scale),
                            dtype=self.dtype, num_q_heads=cfg.num_attention_heads,
                            num_kv_heads=self.num_cache_kv_heads, head_dim=cfg.head_dim,
                            rt=rt or self.runtime, lora_slots=lora_slots,
                            num_lora_slots=self.lora_slots)

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Preallocate `max_loras` adapter slots of rank <= `max_lora_rank` in every layer
        (zeros: slot contents come from `pack_adapter` in qwen_jax/lora_packing.py)."""
        lora_layers.enable_lora(self, max_loras, max_lora_rank)

    def _forward_capturing(self, x, kv_caches: KVCache, ctx: StepContext):
        """The layers, keeping the hidden states entering `aux_layers` (EAGLE-3's input):
        -> (last hidden [T, D], the segments' caches, aux [T, len(aux_layers) * D])."""
        unique = sorted(set(self.aux_layers))
        kept = jnp.zeros((len(unique) + 1, *x.shape), x.dtype)
        new_caches = []
        for stack, kv, (_, first, count) in zip(self.segments, kv_caches, self.config.segments):
            slots = np.full(count, len(unique), np.int32)
            for i, layer in enumerate(unique):
                if first <= layer < first + count:
                    slots[layer - first] = i
            x, kv, kept = run_segment(stack, x, kv, ctx, self.runtime,
                                      (jnp.asarray(slots), kept))
            new_caches.append(kv)
        aux = jnp.concatenate([kept[unique.index(layer)] for layer in self.aux_layers], -1)
        return x, new_caches, aux

    def hidden_and_aux(self, input_ids: Int[Array | np.ndarray, "B T"], page_size: int = 16):
        """Full sequences (no padding) -> (logits [B, T, V], aux [B, T, 3D]): what an
        EAGLE-3 head is trained on (scripts/train_eagle3.py)."""
        batch, seq_len = input_ids.shape
        meta, num_pages = contiguous_metadata(batch, seq_len, page_size)
        positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), batch)
        x = self.embed_tokens[...][input_ids.reshape(-1)]
        ctx = self.step_context(meta, positions)
        caches = self.init_kv_caches(num_pages, page_size)
        x, _, aux = self._forward_capturing(x, caches, ctx)
        logits = self.compute_logits(self.norm(x))
        return logits.reshape(batch, seq_len, -1), aux.reshape(batch, seq_len, -1)

    def compute_logits(self, hidden: Float[Array, "*B D"]) -> Float[Array, "*B V"]:
        """hidden: [..., D] -> float32 logits [..., V]."""
        head = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)

    @property
    def impl(self) -> str:
        return self.runtime.impl

    @property
    def mesh(self):
        return self.runtime.mesh

    def use_kernel_table(self, table) -> None:
        """Run each op's implementation per shape as `table` (a KernelTable) says; None:
        the model's impl everywhere. Set before the step is traced."""
        self.runtime = dataclasses.replace(self.runtime, kernel_table=table)

    @property
    def num_cache_kv_heads(self) -> int:
        """K' = K, or TP when TP > K (each device keeps a copy of its KV head)."""
        k = self.config.num_key_value_heads
        return k * sharding.kv_replication(k, self.mesh)

    def init_kv_caches(self, num_pages: int, page_size: int, dtype=None) -> KVCache:
        """Zeroed caches: per segment of X layers, K and V of [X * num_pages, L, K', H],
        created directly in their shards (kv heads over the model axis) under a mesh."""
        cfg = self.config
        dtype = dtype or self.dtype
        device = None if self.mesh is None else sharding.kv_cache_sharding(self.mesh)
        shape = lambda count: (count * num_pages, page_size, self.num_cache_kv_heads, cfg.head_dim)
        zeros = lambda count: sharding.zeros(shape(count), dtype, device)
        caches: list[tuple] = [(zeros(c), zeros(c)) for _, _, c in cfg.segments]
        if self.aux_layers:  # last: the hidden states EAGLE-3 reads, by slot
            width = len(self.aux_layers) * cfg.hidden_size
            target = None if self.mesh is None else sharding.replicated(self.mesh)
            caches.append((sharding.zeros((num_pages, page_size, width), self.dtype, target),))
        return caches

    # ---- full-sequence path ------------------------------------------------------------
    def __call__(self, input_ids: Int[Array | np.ndarray, "B T"], page_size: int = 16,
                 lora_slots: Int[Array | np.ndarray, " B"] | None = None
                 ) -> Float[Array, "B T V"]:
        """input_ids: int32[B, T] -> float32 logits [B, T, V] (causal, no padding);
        lora_slots: each sequence's adapter slot (0: none; see `enable_lora`)."""
        batch, seq_len = input_ids.shape
        meta, num_pages = contiguous_metadata(batch, seq_len, page_size)
        positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), batch)
        caches = self.init_kv_caches(num_pages, page_size)
        token_slots = (None if lora_slots is None
                       else jnp.repeat(jnp.asarray(lora_slots, jnp.int32), seq_len))
        hidden, _ = self.forward(input_ids.reshape(-1).astype(jnp.int32), positions, caches, meta,
                                 token_slots)
        return self.compute_logits(hidden).reshape(batch, seq_len, -1)

    @classmethod
    def from_pretrained(cls, path, dtype="float32", *, impl: str | None = None,
                        load_format: str = "auto", mesh=None, seed: int = 0,
                        quantization: str | None = None) -> "Qwen3ForCausalLM":
        """Load an HF safetensors checkpoint, an orbax checkpoint written by
        `qwen-jax convert`, or (load_format="dummy" or a preset name) random weights drawn
        from `seed`; with a `mesh` (qwen_jax.sharding.make_mesh) every weight lands in its
        shards. Quantised checkpoints (fp8, AWQ) load as they are; quantization="fp8" |
        "int8" quantises a float one at load (qwen_jax/quantization.py)."""
        return weights.load_model(path, dtype, model_cls=cls, impl=impl,
                                  load_format=load_format, seed=seed, mesh=mesh,
                                  quantization=quantization)


def contiguous_metadata(batch: int, seq_len: int, page_size: int):
    """Metadata of B whole sequences of length T laid out on consecutive pages after page 0."""
    pages_per_seq = -(-seq_len // page_size)
    page_table = 1 + np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, pages_per_seq)
    pos = np.arange(seq_len)
    slots = page_table[:, pos // page_size] * page_size + pos % page_size  # [B, T]
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(slots.reshape(-1), jnp.int32),
        query_start=jnp.arange(batch + 1, dtype=jnp.int32) * seq_len,
        kv_lens=jnp.full((batch,), seq_len, jnp.int32),
        page_table=jnp.asarray(page_table),
        num_seqs=jnp.asarray(batch, jnp.int32))
    return meta, 1 + batch * pages_per_seq
