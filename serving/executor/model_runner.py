"""The jitted step: forward over the padded ragged batch, lm head on the sampled rows,
sampling. One executable per (token bucket, sequence bucket); the KV cache is donated.
A step with prompt rows to score (vLLM's prompt_logprobs: serving/engine/prompt_scoring.py)
also takes their rows and next tokens and returns their logprobs: one executable per
(T, S, R) with R the scored rows padded to a token bucket, compiled the first time."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from qwen_jax.attention import AttentionMetadata
from qwen_jax.lora_layers import write_slot
from qwen_jax.sharding import replicated
from serving.core.speculative import MAX_SPECULATIVE_TOKENS
from serving.executor.dispatch import DispatchThread, PendingStep, done
from serving.executor.model_inputs import ModelInputs
from serving.executor.shared_executables import (
    SHARED,
    hashable_or_none,
    signature,
    trace_options,
    traced_function,
)
from serving.executor.transfer import pack, packed_size, unpack
from serving.sample.sampler import sample, token_logprobs
from serving.sample.sampling_arrays import (
    SamplerOutput,
    SamplingArrays,
    build_sampling_arrays,
    uses_penalty_rows,
)
from serving.structured_output.token_mask import TokenMask, inactive_mask

logger = logging.getLogger(__name__)


# The padded batch crosses into the jitted step as a pytree of its arrays.
jax.tree_util.register_dataclass(
    ModelInputs, data_fields=[f.name for f in dataclasses.fields(ModelInputs)], meta_fields=[])


def attention_metadata(inputs: ModelInputs) -> AttentionMetadata:
    """Where each of the batch's tokens sits in the paged cache, as attention reads it."""
    return AttentionMetadata(slot_mapping=inputs.slot_mapping, query_start=inputs.query_start,
                             kv_lens=inputs.kv_lens, page_table=inputs.page_table,
                             num_seqs=inputs.num_seqs)


class ModelRunner:
    """Owns the params, the KV cache and the compiled steps."""

    def __init__(self, model, kv_caches, *, max_model_len: int, pages_per_seq: int, mesh=None,
                 max_num_seqs: int = 256, dispatch_thread: bool | None = None):
        """max_num_seqs: the largest sequence bucket. dispatch_thread: device calls from a
        `DispatchThread` (None: unless the devices are CPUs, whose calls return at once)."""
        self.graphdef, self.state = nnx.split(model)
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.pages_per_seq = pages_per_seq
        self.max_num_seqs = max_num_seqs
        # The width of `next_tokens` and `prev_tokens`: the sampled ids, or a draft model's
        # or EAGLE-3 head's drafts (serving/engine/speculation.py), k <= the most allowed a
        # sequence; the same with or without a draft model, so engines of the same shapes
        # share their compiled steps (serving/executor/shared_executables.py).
        self.prev_width = max_num_seqs * MAX_SPECULATIVE_TOKENS
        self.vocab_size = model.config.vocab_size
        # (T, S) -> step; (T, S, R) -> the step scoring R prompt rows
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        # Device-resident defaults, never sent: per S the inactive grammar mask and the
        # no-penalty token array; one zero `next_tokens` for a step with no step before.
        self._inactive_masks: dict[int, TokenMask] = {}
        self._no_penalties: dict[int, jax.Array] = {}
        self._no_prev_tokens: jax.Array | None = None
        # Under a mesh the host inputs go to every device (replicated) and the caches keep
        # their kv-head shards across steps.
        self._inputs_sharding: NamedSharding | None = None if mesh is None else replicated(mesh)
        cache_shardings = None if mesh is None else jax.tree.map(lambda x: x.sharding, kv_caches)
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnums=(7,),
                             out_shardings=None if mesh is None else (cache_shardings,
                                                                      replicated(mesh)))
        self._dispatch_thread: DispatchThread | None = None
        if dispatch_thread is None:
            devices = jax.devices() if mesh is None else mesh.devices.flat
            dispatch_thread = any(d.platform != "cpu" for d in devices)
        self.dispatch_thread = dispatch_thread

    @property
    def num_compiles(self) -> int:
        """Executables built so far: one per (T, S) bucket (all at start-up), plus one per
        (T, S, R) the first time a step scores R prompt rows (prompt_logprobs)."""
        return len(self._executables)

    def _step_impl(self, state, kv_caches, words, penalty_tokens, token_mask, prev_tokens,
                   score_rows, bucket: tuple[int, int]):
        """words: the step's small inputs packed (serving/executor/transfer.py); penalty_tokens and
        token_mask travel apart (large, and device-resident when unused); prev_tokens:
        the previous step's `next_tokens` (or a proposal's flat drafts), read where
        inputs.prev_index >= 0; score_rows:
        None, or int32[2, R]: prompt rows to score and the token after each."""
        inputs, sampling = unpack(words, self._packed_template(bucket))
        sampling = dataclasses.replace(sampling, penalty_tokens=penalty_tokens,
                                       token_mask=token_mask)
        from_prev = prev_tokens[jax.numpy.maximum(inputs.prev_index, 0)]
        token_ids = jax.numpy.where(inputs.prev_index >= 0, from_prev, inputs.token_ids)
        # A row with a token in flight decodes it: its last input is that token.
        sampling = dataclasses.replace(sampling,
                                       pending_tokens=token_ids[inputs.logits_index])
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model.forward(token_ids, inputs.positions, kv_caches,
                                          attention_metadata(inputs), inputs.lora_slots)
        logits = model.compute_logits(hidden[inputs.logits_index])  # [S, V] f32
        out = sample(logits, sampling)
        if score_rows is not None:
            scored = jax.nn.log_softmax(model.compute_logits(hidden[score_rows[0]]), axis=-1)
            out = dataclasses.replace(out, prompt_logprobs=token_logprobs(scored, score_rows[1]))
        next_tokens = jax.numpy.zeros(self.prev_width, jax.numpy.int32).at[
            :bucket[1]].set(out.token_ids)
        return kv_caches, (out, next_tokens)

    def _packed_template(self, bucket: tuple[int, int]):
        """Shapes and dtypes of what `dispatch` packs for a (T, S) bucket."""
        t, s = bucket
        host = (padding_inputs(t, s, self.pages_per_seq),
                _small(padding_sampling(s, self.max_model_len, self.vocab_size)))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                            host)

    def execute(self, inputs: ModelInputs, sampling: SamplingArrays) -> SamplerOutput:
        """Run one step and wait for it: its sampled tokens and logprobs as host arrays."""
        return self.dispatch(inputs, sampling).result()

    def dispatch(self, inputs: ModelInputs, sampling: SamplingArrays,
                 prev: PendingStep | jax.Array | None = None,
                 score_rows: np.ndarray | None = None) -> PendingStep:
        """Start one step and return at once. Host to device: one packed int32 buffer,
        plus the penalty tokens / grammar mask only when some row uses them (otherwise
        device-resident defaults). `prev`: the step whose sampled tokens rows with
        inputs.prev_index >= 0 take as input, or a proposal's flat drafts int32[prev_width]
        (DraftRunner.dispatch). `score_rows`: int32[2, R] prompt rows to
        score (their logprobs come back as the output's prompt_logprobs)."""
        words = pack((inputs, _small(sampling)))
        return self._dispatch_words(words, sampling, inputs.bucket, score_rows, prev)

    def _dispatch_words(self, words: np.ndarray, sampling: SamplingArrays,
                        bucket: tuple[int, int], score_rows: np.ndarray | None,
                        prev: PendingStep | jax.Array | None) -> PendingStep:
        """Start the (T, S) step on the packed inputs `words`; see `dispatch`."""
        num_seqs = bucket[1]
        mask = sampling.token_mask
        mask_arg = (mask if mask is not None and mask.active
                    else self._resident(self._inactive_masks, num_seqs, lambda: inactive_mask(
                        num_seqs, self.vocab_size)))
        penalties = (sampling.penalty_tokens if uses_penalty_rows(sampling)
                     else self._resident(self._no_penalties, num_seqs, lambda: padding_sampling(
                         num_seqs, self.max_model_len, self.vocab_size).penalty_tokens))
        args = [words, penalties, mask_arg]
        key = bucket if score_rows is None else (*bucket, score_rows.shape[1])
        if self._inputs_sharding is not None:  # host leaves -> replicated global arrays
            args = [jax.tree.map(lambda x: x if isinstance(x, jax.Array) else self._replicate(x),
                                 a) for a in args]
        want_logprobs = bool(sampling.want_logprobs)
        scored = (None if score_rows is None else self._replicate(score_rows)
                  if self._inputs_sharding is not None else score_rows)

        def launch():
            step = self._executables.get(key) or self._compile([key])[0]
            out, next_tokens = self._run(step, args, scored, prev)
            wanted = out if want_logprobs else (out.token_ids, out.prompt_logprobs)
            for leaf in jax.tree.leaves(wanted):
                leaf.copy_to_host_async()  # the copy back starts as soon as it is ready
            return out, next_tokens

        thread = self._dispatch_thread
        return PendingStep(done(launch) if thread is None else thread.submit(launch),
                           want_logprobs)

    def _run(self, step, args: list, scored, prev: PendingStep | jax.Array | None):
        """Call a compiled step on the device state; returns (output, next_tokens)."""
        prev_tokens = (prev if isinstance(prev, jax.Array) else self._zero_prev_tokens()
                       if prev is None else prev.next_tokens)
        self.kv_caches, (out, next_tokens) = step(self.state, self.kv_caches, *args,
                                                  prev_tokens, scored)
        return out, next_tokens

    @property
    def dispatch_thread(self) -> bool:
        """Whether device calls go through a `DispatchThread` (by default: off the CPU)."""
        return self._dispatch_thread is not None

    @dispatch_thread.setter
    def dispatch_thread(self, on: bool) -> None:
        if on and self._dispatch_thread is None:
            self._dispatch_thread = DispatchThread()
        elif not on and self._dispatch_thread is not None:
            thread = self._dispatch_thread
            self._dispatch_thread = None
            thread.close()  # after the calls already submitted

    def _on_device_thread(self, fn: Callable[[], object]):
        """fn() after every step dispatched before it (it reads or replaces the caches)."""
        thread = self._dispatch_thread
        return fn() if thread is None else thread.call(fn)

    def _resident(self, cache: dict, num_seqs: int, make):
        if num_seqs not in cache:
            cache[num_seqs] = jax.tree.map(
                self._replicate if self._inputs_sharding is not None else jax.device_put,
                make())
        return cache[num_seqs]

    def _zero_prev_tokens(self) -> jax.Array:
        if self._no_prev_tokens is None:
            zeros = np.zeros(self.prev_width, np.int32)
            self._no_prev_tokens = (self._replicate(zeros) if self._inputs_sharding is not None
                                    else jax.device_put(zeros))
        return self._no_prev_tokens

    def write_lora_slot(self, index: int, packed: list[dict]) -> None:
        """LoRA buffer `index` <- a packed adapter (qwen_jax/lora_packing.py), after every step
        already dispatched (the buffers are donated to the write)."""
        def write():
            model = nnx.merge(self.graphdef, self.state)
            write_slot(model, index, packed)
            self.graphdef, self.state = nnx.split(model)
        self._on_device_thread(write)

    def copy_pages_to_host(self, store, device_pages, host_pages) -> None:
        """Swap out: `store` (serving/executor/swap_store.py) keeps the pages' KV."""
        self._on_device_thread(lambda: store.save(self.kv_caches, list(device_pages),
                                                  list(host_pages)))

    def copy_pages_from_host(self, store, host_pages, device_pages) -> None:
        """Swap in: the stored pages' KV lands in `device_pages` (the cache is donated)."""
        def load():
            self.kv_caches = store.load(self.kv_caches, list(host_pages), list(device_pages))
        self._on_device_thread(load)

    def _replicate(self, host: np.ndarray) -> jax.Array:
        """Host array -> global replicated array (under a mesh); works across processes too,
        where each process holds the same (broadcast) values."""
        if self._inputs_sharding is None:
            raise ValueError("replicating inputs needs a mesh")
        host = np.asarray(host)
        return jax.make_array_from_callback(host.shape, self._inputs_sharding,
                                            lambda index: host[index])

    def _abstract_args(self, key):
        """The step's arguments after state and caches, as ShapeDtypeStructs; key: (T, S),
        or (T, S, R) for a step scoring R prompt rows."""
        bucket = tuple(key[:2])
        sampling = padding_sampling(bucket[1], self.max_model_len, self.vocab_size)
        host = (np.zeros(packed_size(self._packed_template(bucket)), np.int32),
                sampling.penalty_tokens, sampling.token_mask,
                np.zeros(self.prev_width, np.int32),
                None if len(key) == 2 else np.zeros((2, key[2]), np.int32))
        return (*jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            np.shape(x), np.asarray(x).dtype, sharding=self._inputs_sharding), host), bucket)

    def _compile(self, buckets, progress: bool = False, on_compiled=None):
        """Each bucket's step: the process's shared executable where one fits
        (serving/executor/shared_executables.py), else traced and lowered (Python, serial)
        and compiled on a thread pool: XLA compiles in C++ without the GIL, so buckets
        build in parallel. on_compiled(bucket, executable, seconds) is called as each one
        is ready."""
        from tqdm import tqdm
        keys = self._shared_keys(buckets)

        def compile_one(bucket, low):
            start = time.perf_counter()
            executable = low.compile()
            if on_compiled is not None:
                on_compiled(bucket, executable, time.perf_counter() - start)
            return executable

        def compile_all(indices, lowered):
            todo = [buckets[i] for i in indices]
            workers = max(1, min(len(todo), os.cpu_count() or 1))
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                return list(tqdm(pool.map(compile_one, todo, lowered), total=len(todo),
                                 desc="compiling buckets", unit="bucket",
                                 disable=not progress))

        compiled, built = SHARED.compile(self, keys, lambda i: self._step.lower(
            self.state, self.kv_caches, *self._abstract_args(buckets[i])), compile_all)
        if on_compiled is not None:
            for i in set(range(len(buckets))) - set(built):  # shared: nothing to wait for
                on_compiled(buckets[i], compiled[i], 0.0)
        self._executables.update(zip(buckets, compiled))
        return compiled

    def _shared_keys(self, buckets) -> list:
        """What each bucket's trace depends on (None: not shareable)."""
        common = (traced_function(self._step), self.graphdef, self.max_model_len,
                  self.pages_per_seq, self.max_num_seqs, self.prev_width, self.vocab_size,
                  trace_options(), signature(self.state), signature(self.kv_caches))
        return [hashable_or_none((common, signature(self._abstract_args(b)))) for b in buckets]

    def precompile(self, pairs, progress: bool = True, on_compiled=None) -> float:
        """Compile every (T, S) bucket up front, so serving never compiles."""
        start = time.perf_counter()
        self._compile([tuple(p) for p in pairs], progress, on_compiled)
        return time.perf_counter() - start


def padding_inputs(num_tokens: int, num_seqs: int, pages_per_seq: int) -> ModelInputs:
    """A batch with no real token: everything writes to the scratch page."""
    zeros = lambda *shape: np.zeros(shape, np.int32)
    return ModelInputs(token_ids=zeros(num_tokens), positions=zeros(num_tokens),
                       slot_mapping=zeros(num_tokens), query_start=zeros(num_seqs + 1),
                       kv_lens=zeros(num_seqs), page_table=zeros(num_seqs, pages_per_seq),
                       logits_index=zeros(num_seqs), num_seqs=np.array(0, np.int32),
                       prev_index=np.full(num_tokens, -1, np.int32), lora_slots=zeros(num_tokens))


def _small(sampling: SamplingArrays) -> SamplingArrays:
    """The sampling arrays that travel packed: all but penalty tokens and grammar mask
    (None here: no leaves; the step puts its own back before sampling)."""
    return dataclasses.replace(sampling, penalty_tokens=None,  # type: ignore[arg-type]
                               token_mask=None)


def padding_sampling(num_seqs: int, max_model_len: int, vocab_size: int) -> SamplingArrays:
    return build_sampling_arrays([], num_seqs, max_model_len, vocab_size)
