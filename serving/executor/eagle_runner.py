"""The EAGLE-3 head of speculative decoding (`speculative_config` method `eagle3`,
qwen_jax/eagle3.py): one jitted proposal per (T, S) bucket, as the draft model's
(serving/executor/draft_runner.py), with the head's one layer of K/V over the target's
page ids.

The target's step keeps, for every token it computes, the hidden states entering the
head's three layers in its caches' last entry, by KV slot (qwen_jax/model.py
`aux_layers`), so they outlive the step and follow the pages: prefix-cache hits share
them and swapping copies them with the K/V. A proposal is one call: the head over the
positions its cache lacks (catch-up: at position i, `fc` of the target's hidden states
read at i's slot, and token i + 1's embedding; the input ids are the next tokens, see
serving/engine/draft_proposer.py), a greedy draft from each sequence's last row, then
k - 1 single-token passes, each feeding the head's pre-norm output and the draft it drew
back in at the next position. Returns the drafts [S, k] as target ids.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from qwen_jax.attention import step_context
from qwen_jax.eagle3 import Eagle3Head
from qwen_jax.layers import Runtime
from serving.executor.draft_runner import DraftRunner, chained_metadata
from serving.executor.model_inputs import ModelInputs
from serving.executor.model_runner import attention_metadata


class EagleRunner(DraftRunner):
    def __init__(self, head: Eagle3Head, kv_cache, *, embed_tokens: jax.Array,
                 aux_cache: Callable[[], jax.Array], runtime: Runtime, num_drafts: int,
                 page_size: int, pages_per_seq: int, width: int):
        """embed_tokens: the target's [V, D] (used when the head has none); aux_cache:
        the target's kept hidden states [P, L, 3D] as they are now (read, never donated);
        runtime: the target's kernels and mesh."""
        self.embed_tokens = embed_tokens
        self.aux_cache = aux_cache
        self.runtime = runtime
        super().__init__(head, kv_cache, num_drafts=num_drafts, page_size=page_size,
                         pages_per_seq=pages_per_seq, width=width, mesh=runtime.mesh)

    def extra_args(self) -> tuple:
        return self.embed_tokens, self.aux_cache()

    def _pass(self, head: Eagle3Head, embed, token_ids, positions, hidden, kv_cache, meta):
        cfg = head.config
        ctx = step_context(meta, positions, (head.rope_inv_freq[...], head.rope_scale),
                           dtype=head.dtype, num_q_heads=cfg.num_attention_heads,
                           num_kv_heads=head.num_cache_kv_heads, head_dim=cfg.head_dim,
                           rt=self.runtime)
        table = embed if head.embed_tokens is None else head.embed_tokens[...]
        return head(table[token_ids], hidden, kv_cache, ctx, self.runtime)

    def _propose_impl(self, state, kv_cache, inputs: ModelInputs, *extra):
        embed, aux_cache = extra  # extra_args()
        head = nnx.merge(self.graphdef, state)
        aux = aux_cache.reshape(-1, aux_cache.shape[-1])[inputs.slot_mapping]  # [T, 3D]
        normed, prenorm, kv_cache = self._pass(
            head, embed, inputs.token_ids, inputs.positions, head.fc(aux.astype(head.dtype)),
            kv_cache, attention_metadata(inputs))
        drafts = [head.draft_tokens(normed[inputs.logits_index])]
        hidden = prenorm[inputs.logits_index]
        for j in range(1, self.num_drafts):
            position, meta = chained_metadata(inputs, j, self.page_size)
            normed, hidden, kv_cache = self._pass(head, embed, drafts[-1], position, hidden,
                                                  kv_cache, meta)
            drafts.append(head.draft_tokens(normed))
        return kv_cache, jnp.stack(drafts, axis=1)


__all__ = ["EagleRunner"]
