"""The draft model of speculative decoding (`speculative_config` method `draft_model`): a
second, smaller Qwen3 with the target's vocabulary, its own KV cache over the same page
ids (one page id holds a token's K/V in both caches), and one jitted proposal per
(T, S) bucket.

A proposal is one call: a forward over the tokens each sequence's draft cache lacks
(its catch-up: the prompt at first, then the tokens the last step kept), greedy on each
sequence's last row, then k - 1 single-token passes, each feeding the draft it drew
back in at the next position (slots from the page table on the device), greedy again.
Its drafts stay on the device, flat (row r's draft j at r * k + j) and zero-padded to
`width` (the target step's `prev_tokens`): the verify step reads them there
(serving/engine/speculation.py), and the host reads them when it verifies. Where a
draft's position falls in a page the target has not allocated yet (the page table's 0,
the scratch page), its K/V lands there: drafts after it may be worse; the tokens the
target keeps are not (it verifies them).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen_jax.attention import AttentionMetadata
from qwen_jax.sharding import replicated
from serving.executor.model_inputs import ModelInputs
from serving.executor.model_runner import attention_metadata, padding_inputs
from serving.executor.shared_executables import (
    SHARED,
    hashable_or_none,
    signature,
    trace_options,
    traced_function,
)


def chained_metadata(inputs: ModelInputs, offset: int, page_size: int):
    """The single-token pass `offset` positions past each sequence's last catch-up
    position (kv_lens - 1): (positions int32[S], its AttentionMetadata), padding rows on
    the scratch page; slots from the page table on the device."""
    num_padded = inputs.logits_index.shape[0]
    rows = jnp.arange(num_padded)
    real = rows < inputs.num_seqs
    table = inputs.page_table
    position = jnp.where(real, inputs.kv_lens - 1 + offset, 0)
    page = jnp.clip(position // page_size, 0, table.shape[1] - 1)
    slot = jnp.where(real, table[rows, page] * page_size + position % page_size, 0)
    meta = AttentionMetadata(
        slot_mapping=slot, query_start=jnp.minimum(jnp.arange(num_padded + 1), inputs.num_seqs),
        kv_lens=jnp.where(real, position + 1, 0), page_table=table, num_seqs=inputs.num_seqs)
    return position, meta


class DraftRunner:
    def __init__(self, model, kv_caches, *, num_drafts: int, page_size: int,
                 pages_per_seq: int, width: int, mesh=None):
        """width: the length of the flat drafts (at least the largest sequence bucket
        times num_drafts); mesh: the target's, whose steps take the drafts replicated."""
        self.graphdef, self.state = nnx.split(model)
        self.kv_caches = kv_caches
        self.num_drafts = num_drafts
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.width = width
        self.config = model.config
        out_shardings = None if mesh is None else (
            jax.tree.map(lambda x: x.sharding, kv_caches), replicated(mesh))
        self._propose = jax.jit(self._propose_flat, donate_argnums=(1,),
                                out_shardings=out_shardings)
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}  # (T, S) -> it

    @property
    def num_compiles(self) -> int:
        return len(self._executables)

    def extra_args(self) -> tuple:
        """Arrays the proposal reads besides its params, caches and inputs (none here)."""
        return ()

    def dispatch(self, inputs: ModelInputs) -> jax.Array:
        """Start the proposal for the catch-up batch `inputs` (each sequence's chunk ends
        at its last known token); returns its flat drafts int32[width] at once, their
        copy to the host started."""
        bucket = inputs.bucket
        if bucket not in self._executables:
            self.precompile([bucket])
        self.kv_caches, drafts = self._executables[bucket](self.state, self.kv_caches, inputs,
                                                           *self.extra_args())
        drafts.copy_to_host_async()
        return drafts

    def precompile(self, pairs) -> float:
        """Compile the proposal of every (T, S) bucket (the engine's), so serving does not;
        shared with the process's other engines as the target's steps are
        (serving/executor/shared_executables.py)."""
        started = time.perf_counter()
        pairs = [tuple(p) for p in pairs]
        shapes = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                               padding_inputs(t, s, self.pages_per_seq)) for t, s in pairs]
        extra = self.extra_args()
        common = (traced_function(self._propose), self.graphdef, self.num_drafts,
                  self.page_size, self.pages_per_seq, self.width, getattr(self, "runtime", None),
                  trace_options(), signature(self.state), signature(self.kv_caches),
                  signature(extra))
        keys = [hashable_or_none((common, signature(shape))) for shape in shapes]
        compiled, _ = SHARED.compile(
            self, keys,
            lambda i: self._propose.lower(self.state, self.kv_caches, shapes[i], *extra),
            lambda indices, lowered: [low.compile() for low in lowered])
        self._executables.update(zip(pairs, compiled))
        return time.perf_counter() - started

    def _propose_flat(self, state, kv_caches, inputs: ModelInputs, *extra):
        """_propose_impl, its drafts [S, k] flattened and zero-padded to `width`."""
        kv_caches, drafts = self._propose_impl(state, kv_caches, inputs, *extra)
        flat = drafts.reshape(-1).astype(jnp.int32)
        return kv_caches, jnp.zeros(self.width, jnp.int32).at[:flat.shape[0]].set(flat)

    def _propose_impl(self, state, kv_caches, inputs: ModelInputs, *extra):
        """-> (caches, drafts int32[S, k])."""
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model.forward(inputs.token_ids, inputs.positions, kv_caches,
                                          attention_metadata(inputs))
        token = jnp.argmax(model.compute_logits(hidden[inputs.logits_index]), axis=-1)
        drafts = [token.astype(jnp.int32)]
        for j in range(1, self.num_drafts):
            position, meta = chained_metadata(inputs, j, self.page_size)
            hidden, kv_caches = model.forward(drafts[-1], position, kv_caches, meta)
            drafts.append(jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32))
        return kv_caches, jnp.stack(drafts, axis=1)


__all__ = ["DraftRunner", "chained_metadata"]
