"""Pipeline stages with several batches in flight: one tick of the pipeline.

The mesh's `stage` axis holds P stages; stage s holds the s-th share of every segment's
stacked layers (and their KV pages). With G segments a batch passes D = G x P virtual
stages: virtual stage v = g x P + s is segment g's share on stage s. In one tick every
stage runs each of its G shares on a different batch: the batch at virtual stage v
entered the pipeline v ticks ago. So D batches are in flight, each stage computes in
every tick (no turn taking), and a batch's final hidden states come out D - 1 ticks
after it entered. Between ticks the hidden states ride in a carry, [P, G, T, D] split
over `stage`: carry[s, g] is what virtual stage g x P + s reads next tick.

Every batch reads and writes each layer's KV pages in the order the batches entered (a
later batch reaches a layer only after every earlier one has passed it), so a sequence's
next chunk may enter while its previous one is in flight, and a page freed by a
finished sequence can be handed to a new one at once. What cannot enter while in flight
is a sequence whose next token is still in the pipeline; the engine's loop keeps those
out (serving/engine/pipeline.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from pallas_kernels.array_types import Array, Float, Int
from qwen_jax import sharding
from qwen_jax.attention import AttentionMetadata
from qwen_jax.model import KVCache, Qwen3ForCausalLM, run_segment


def num_virtual_stages(model: Qwen3ForCausalLM) -> int:
    """D: the batches in flight when every stage is busy (segments x stages)."""
    return len(model.segments) * sharding.pp_size(model.mesh)


def carry_shape(model: Qwen3ForCausalLM, num_tokens: int) -> tuple[int, int, int, int]:
    """The hidden states between ticks for token buckets up to `num_tokens`."""
    return (sharding.pp_size(model.mesh), len(model.segments), num_tokens,
            model.config.hidden_size)


def carry_sharding(model: Qwen3ForCausalLM) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(model.mesh, PartitionSpec("stage"))


def pipeline_tick(model: Qwen3ForCausalLM, token_ids: Int[Array, " T"],
                  positions: Int[Array, "D T"], metas: AttentionMetadata, kv_caches: KVCache,
                  carry: Float[Array, "P G T Dm"]
                  ) -> tuple[Float[Array, "T Dm"], KVCache, Float[Array, "P G T Dm"]]:
    """One tick. token_ids: the entering batch's tokens (virtual stage 0); positions and
    metas (each leaf with a leading axis D): the batch at each virtual stage (a slot with
    no batch: num_seqs 0, every token on the scratch page). Returns the final hidden
    states (normed) of the batch at virtual stage D - 1, the caches and the next carry.

    Every stage takes the same path (no branch on the stage: a collective in a branch
    only some devices take would stall the others); the stage picks its inputs by index."""
    mesh = _stage_mesh(model)
    pp, num_segments = mesh.shape["stage"], len(model.segments)
    splits = [nnx.split(stack) for stack in model.segments]
    graphdefs = [graphdef for graphdef, _ in splits]
    shift = [(i, (i + 1) % pp) for i in range(pp)]
    embedded = model.embed_tokens[...][token_ids]  # [T, Dm]

    def tick(states, kvs, carry, embedded, positions, metas):
        stage = jax.lax.axis_index("stage")
        inner = dataclasses.replace(model.runtime, mesh=jax.sharding.get_abstract_mesh())
        outs, new_kvs = [], []
        for g in range(num_segments):
            v = g * pp + stage
            meta = jax.tree.map(lambda a, v=v: a[v], metas)
            ctx = model.step_context(meta, positions[v], rt=inner)
            h = carry[0, g]
            if g == 0:
                h = jnp.where(stage == 0, embedded, h)
            h, kv = run_segment(nnx.merge(graphdefs[g], states[g]), h, kvs[g], ctx, inner)
            outs.append(h)
            new_kvs.append(kv)
        sent = jax.lax.ppermute(jnp.stack(outs), "stage", shift)  # [G, T, Dm] from stage - 1
        # Stage 0 got the last stage's outputs: segment g's feeds segment g + 1, and the
        # last segment's is the pipeline's output.
        final = jax.lax.psum(jnp.where(stage == 0, sent[-1], jnp.zeros_like(sent[-1])),
                             "stage")
        carry = jnp.where(stage == 0, jnp.roll(sent, 1, axis=0), sent)
        return final, new_kvs, carry[None]

    stage_split, rep = PartitionSpec("stage"), PartitionSpec()
    final, kv_caches, carry = jax.shard_map(
        tick, mesh=mesh, in_specs=(stage_split, stage_split, stage_split, rep, rep, rep),
        out_specs=(rep, stage_split, stage_split), axis_names={"stage"}, check_vma=False)(
        [state for _, state in splits], list(kv_caches), carry, embedded, positions, metas)
    return model.norm(final), kv_caches, carry


def _stage_mesh(model: Qwen3ForCausalLM):
    """The model's mesh, or the context's abstract mesh of the same axes where there is one
    (lowering for CUDA without a GPU: pallas_kernels/cuda_lowering.py)."""
    mesh = model.runtime.mesh
    assert mesh is not None, "pipeline stages need a mesh with a stage axis"
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.axis_names == mesh.axis_names:
        return context
    return mesh
