"""The draft model of speculative decoding (`speculative_config` method `draft_model`): a
second, smaller Qwen3 with the target's vocabulary, its own KV cache over the same page
ids (one page id holds a token's K/V in both caches), and one jitted proposal per
(T, S) bucket.

A proposal is one call: a forward over the tokens each sequence's draft cache lacks
(its catch-up: the prompt at first, then the tokens the last step kept), greedy on each
sequence's last row, then k - 1 single-token passes, each feeding the draft it drew
back in at the next position (slots from the page table on the device), greedy again.
Returns the drafts [S, k]. Where a draft's position falls in a page the target has not
allocated yet (the page table's 0, the scratch page), its K/V lands there: drafts after
it may be worse; the tokens the target keeps are not (it verifies them).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen_jax.attention import AttentionMetadata
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
                 pages_per_seq: int):
        self.graphdef, self.state = nnx.split(model)
        self.kv_caches = kv_caches
        self.num_drafts = num_drafts
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.config = model.config
        self._propose = jax.jit(self._propose_impl, donate_argnums=(1,))
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}  # (T, S) -> it

    @property
    def num_compiles(self) -> int:
        return len(self._executables)

    def extra_args(self) -> tuple:
        """Arrays the proposal reads besides its params, caches and inputs (none here)."""
        return ()

    def propose(self, inputs: ModelInputs) -> np.ndarray:
        """Drafts int32[S, k] for the catch-up batch `inputs` (each sequence's chunk ends
        at its last known token); waits for them."""
        bucket = inputs.bucket
        if bucket not in self._executables:
            self.precompile([bucket])
        self.kv_caches, drafts = self._executables[bucket](self.state, self.kv_caches, inputs,
                                                           *self.extra_args())
        return np.asarray(drafts)

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
                  self.page_size, self.pages_per_seq, getattr(self, "runtime", None),
                  trace_options(), signature(self.state), signature(self.kv_caches),
                  signature(extra))
        keys = [hashable_or_none((common, signature(shape))) for shape in shapes]
        compiled, _ = SHARED.compile(
            self, keys,
            lambda i: self._propose.lower(self.state, self.kv_caches, shapes[i], *extra),
            lambda indices, lowered: [low.compile() for low in lowered])
        self._executables.update(zip(pairs, compiled))
        return time.perf_counter() - started

    def _propose_impl(self, state, kv_caches, inputs: ModelInputs, *extra):
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
