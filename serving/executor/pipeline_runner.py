"""The jitted pipeline tick (qwen_jax/pipeline.py) behind the model runner's dispatch: D
batches in flight over the stages, the one entering and the one leaving named by the
engine's loop (serving/engine/pipeline.py). One executable per (T, S), as the step's:
T and S are the largest of the D batches' buckets, each batch padded to them. The
hidden states between ticks stay on the devices, donated to each tick like the cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen_jax import pipeline
from qwen_jax.attention import AttentionMetadata
from qwen_jax.sharding import replicated
from serving.executor.dispatch import PendingStep
from serving.executor.model_inputs import ModelInputs
from serving.executor.model_runner import (
    ModelRunner,
    _small,
    padding_inputs,
    padding_sampling,
)
from serving.executor.transfer import pack, packed_size, unpack
from serving.sample.sampler import sample, token_logprobs
from serving.sample.sampling_arrays import SamplingArrays


class PipelineRunner(ModelRunner):
    """A ModelRunner whose step is one pipeline tick (`dispatch_tick`)."""

    def __init__(self, model, kv_caches, *, max_num_tokens: int, **kwargs):
        """max_num_tokens: the largest token bucket (the carry's length)."""
        super().__init__(model, kv_caches, **kwargs)
        self.depth = pipeline.num_virtual_stages(model)
        carry_sharding = pipeline.carry_sharding(model)
        self.carry = jax.device_put(
            jnp.zeros(pipeline.carry_shape(model, max_num_tokens), model.dtype), carry_sharding)
        cache_shardings = jax.tree.map(lambda x: x.sharding, kv_caches)
        self._step = jax.jit(self._tick_impl, donate_argnums=(1, 2), static_argnums=(7,),
                             out_shardings=(cache_shardings, carry_sharding,
                                            replicated(model.mesh)))

    def dispatch_tick(self, batches: list[ModelInputs | None], sampling: SamplingArrays,
                      bucket: tuple[int, int], score_rows: np.ndarray | None = None
                      ) -> PendingStep:
        """Start one tick and return at once. batches[v]: the batch at virtual stage v
        (None: an empty slot), each padded here to `bucket`; sampling: the rows of the
        leaving batch (batches[-1]), `score_rows` its prompt rows to score."""
        return self.dispatch_stacked(self.stack(batches, bucket), sampling, bucket, score_rows)

    def stack(self, batches: list[ModelInputs | None], bucket: tuple[int, int]) -> ModelInputs:
        """The batches in flight padded to `bucket`, each leaf with a leading axis D."""
        if len(batches) != self.depth:
            raise ValueError(f"a tick takes {self.depth} batches, got {len(batches)}")
        padded = [pad_inputs(b, bucket, self.pages_per_seq) for b in batches]
        return jax.tree.map(lambda *leaves: np.stack(leaves), *padded)

    def dispatch_stacked(self, stacked: ModelInputs, sampling: SamplingArrays,
                         bucket: tuple[int, int], score_rows: np.ndarray | None = None
                         ) -> PendingStep:
        """`dispatch_tick` of batches already stacked (what several processes send)."""
        return self._dispatch_words(pack((stacked, _small(sampling))), sampling, bucket,
                                    score_rows, None)

    def _run(self, step, args: list, scored, prev: PendingStep | jax.Array | None):
        self.kv_caches, self.carry, out = step(self.state, self.kv_caches, self.carry, *args,
                                               scored)
        return out, None

    def _tick_impl(self, state, kv_caches, carry, words, penalty_tokens, token_mask,
                   score_rows, bucket: tuple[int, int]):
        inputs, sampling = unpack(words, self._packed_template(bucket))
        leaving = jax.tree.map(lambda x: x[-1], inputs)
        sampling = dataclasses.replace(
            sampling, penalty_tokens=penalty_tokens, token_mask=token_mask,
            pending_tokens=leaving.token_ids[leaving.logits_index])
        metas = AttentionMetadata(slot_mapping=inputs.slot_mapping,
                                  query_start=inputs.query_start, kv_lens=inputs.kv_lens,
                                  page_table=inputs.page_table, num_seqs=inputs.num_seqs)
        model = nnx.merge(self.graphdef, state)
        t = bucket[0]
        hidden, kv_caches, moved = pipeline.pipeline_tick(
            model, inputs.token_ids[0], inputs.positions, metas, kv_caches, carry[:, :, :t])
        carry = jax.lax.dynamic_update_slice_in_dim(carry, moved.astype(carry.dtype), 0, 2)
        out = sample(model.compute_logits(hidden[leaving.logits_index]), sampling)
        if score_rows is not None:
            scored = jax.nn.log_softmax(model.compute_logits(hidden[score_rows[0]]), axis=-1)
            out = dataclasses.replace(out, prompt_logprobs=token_logprobs(scored, score_rows[1]))
        return kv_caches, carry, out

    def _packed_template(self, bucket: tuple[int, int]):
        t, s = bucket
        stacked = jax.tree.map(lambda x: np.zeros((self.depth, *np.shape(x)), x.dtype),
                               padding_inputs(t, s, self.pages_per_seq))
        host = (stacked, _small(padding_sampling(s, self.max_model_len, self.vocab_size)))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                            host)

    def _abstract_args(self, key):
        bucket = tuple(key[:2])
        sampling = padding_sampling(bucket[1], self.max_model_len, self.vocab_size)
        host = (np.zeros(packed_size(self._packed_template(bucket)), np.int32),
                sampling.penalty_tokens, sampling.token_mask,
                None if len(key) == 2 else np.zeros((2, key[2]), np.int32))
        carry = jax.ShapeDtypeStruct(self.carry.shape, self.carry.dtype,
                                     sharding=self.carry.sharding)
        return (carry, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            np.shape(x), np.asarray(x).dtype, sharding=self._inputs_sharding), host), bucket)


def pad_inputs(inputs: ModelInputs | None, bucket: tuple[int, int],
               pages_per_seq: int) -> ModelInputs:
    """A batch padded to a larger (T, S) (None: a batch of padding alone): padding tokens
    on the scratch page, padding sequences of length 0, as model_inputs.py lays them out."""
    padded = padding_inputs(*bucket, pages_per_seq)
    if inputs is None:
        return padded
    t, s = inputs.bucket
    for name in ("token_ids", "positions", "slot_mapping", "prev_index", "lora_slots"):
        getattr(padded, name)[:t] = getattr(inputs, name)
    padded.query_start[:s + 1] = inputs.query_start
    padded.query_start[s + 1:] = inputs.query_start[-1]
    padded.kv_lens[:s] = inputs.kv_lens
    padded.page_table[:s] = inputs.page_table
    padded.logits_index[:s] = inputs.logits_index
    padded.num_seqs = np.asarray(inputs.num_seqs, np.int32)
    return padded
