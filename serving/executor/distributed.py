"""Multi-host serving with JAX's multi-controller runtime (`jax.distributed`).

Every process builds the same engine over one global mesh. The scheduler runs on process
0 only: each step it broadcasts the step's inputs (a small header with the bucket shape,
then the padded arrays) and every process runs the same jitted step on them. The other
processes run `follower_loop` until process 0 says stop.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from serving.executor.model_inputs import ModelInputs
from serving.executor.model_runner import padding_inputs, padding_sampling
from serving.sample.sampling_arrays import SamplingArrays

logger = logging.getLogger(__name__)

_STEP, _STOP, _TICK = 1, 2, 3


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None) -> None:
    """`jax.distributed.initialize` behind the CLI flags; a no-op without an address."""
    if coordinator_address is None:
        return
    if num_processes is None or process_id is None:
        raise ValueError("--coordinator-address needs --num-processes and --process-id")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), "
                         f"got {process_id}")
    # CPU collectives across processes need gloo; the setting is inert on GPU backends.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    logger.info("process %d of %d joined %s (%d global devices)", jax.process_index(),
                jax.process_count(), coordinator_address, len(jax.devices()))


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def _broadcast(tree):
    from jax.experimental import multihost_utils
    return multihost_utils.broadcast_one_to_all(tree)


def publish_step(inputs: ModelInputs, sampling: SamplingArrays) -> None:
    """Process 0: send this step's inputs to every other process."""
    _broadcast(np.array([_STEP, *inputs.bucket], np.int32))
    # Structured outputs are refused with several processes, so the grammar mask is the
    # inactive one every follower builds itself: it is not sent.
    _broadcast((inputs, dataclasses.replace(sampling, token_mask=None)))


def publish_tick(stacked: ModelInputs, sampling: SamplingArrays, bucket: tuple[int, int]
                 ) -> None:
    """Process 0: send a pipeline tick's inputs (serving/executor/pipeline_runner.py: the
    batches in flight stacked, the leaving batch's sampling rows)."""
    _broadcast(np.array([_TICK, *bucket], np.int32))
    _broadcast((stacked, dataclasses.replace(sampling, token_mask=None)))


def publish_stop() -> None:
    _broadcast(np.array([_STOP, 0, 0], np.int32))


def receive_step(pages_per_seq: int, max_model_len: int, vocab_size: int, depth: int = 1
                 ) -> tuple[bool, tuple[int, int], ModelInputs, SamplingArrays] | None:
    """Followers: (whether it is a pipeline tick, its bucket, its inputs, its sampling
    rows), or None on stop. depth: the batches a tick stacks."""
    command, num_tokens, num_seqs = (int(x) for x in _broadcast(np.zeros(3, np.int32)))
    if command == _STOP:
        return None
    padding = padding_sampling(num_seqs, max_model_len, vocab_size)
    inputs = padding_inputs(num_tokens, num_seqs, pages_per_seq)
    if command == _TICK:
        inputs = jax.tree.map(lambda x: np.stack([x] * depth), inputs)
    template = (inputs, dataclasses.replace(padding, token_mask=None))
    inputs, sampling = jax.tree.map(np.asarray, _broadcast(template))
    return (command == _TICK, (num_tokens, num_seqs), inputs,
            dataclasses.replace(sampling, token_mask=padding.token_mask))


def follower_loop(engine) -> int:
    """Run the leader's steps (or pipeline ticks) until it stops; returns how many."""
    steps, runner = 0, engine.runner
    while (message := receive_step(engine.pages_per_seq, engine.max_model_len,
                                   engine.model_config.vocab_size,
                                   getattr(runner, "depth", 1))) is not None:
        tick, bucket, inputs, sampling = message
        if tick:
            runner.dispatch_stacked(inputs, sampling, bucket).result()
        else:
            runner.execute(inputs, sampling)
        steps += 1
    return steps
