"""How a step reaches the device without holding the engine's thread: `PendingStep` (a
dispatched step whose outputs stay on the device until read) and `DispatchThread` (one
thread making every device call of a runner, in order)."""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
from collections.abc import Callable

import jax
import numpy as np

from serving.sample.sampling_arrays import SamplerOutput


class PendingStep:
    """A dispatched step: its outputs stay on the device until `result()` reads them.
    `next_tokens` (i32[prev_width], the sampled ids padded) feeds the following step.
    `launched`: the step's call, done or (dispatch thread) still under way; its value is
    (SamplerOutput, next_tokens), whose copy back to the host has been started."""

    def __init__(self, launched: concurrent.futures.Future, want_logprobs: bool):
        self._launched = launched
        self._want_logprobs = want_logprobs
        self._host: SamplerOutput | None = None

    @property
    def next_tokens(self) -> jax.Array:
        return self._launched.result()[1]

    def result(self) -> SamplerOutput:
        """The sampled ids (and logprobs, when a row asked for them) as host arrays: one
        fetch, which waits for the step to finish (and raises what its call raised)."""
        if self._host is None:
            out = self._launched.result()[0]
            if self._want_logprobs:
                self._host = jax.device_get(out)
            else:
                self._host = SamplerOutput(token_ids=np.asarray(out.token_ids), logprobs=None,
                                           prompt_logprobs=jax.device_get(out.prompt_logprobs))
        return self._host


class DispatchThread:
    """One thread that makes every device call of a runner, in the order submitted.

    On a GPU the call of a step does not return at once: XLA runs each `lax.cond` of the
    step (the sampler's branches) by copying its predicate to the host and blocking the
    calling thread until the device has done everything before it (its ConditionalThunk;
    conditionals are not in XLA's default CUDA-graph command types). Called from the
    engine's thread, the step's call would hold that thread for about the whole forward
    pass, and the host work meant to overlap it (the step before's outputs, the next
    schedule) would wait. Here the call blocks this thread instead; JAX releases the GIL
    while it waits.

    The thread needs the GIL again to return from one call and make the next, while the
    engine's thread runs Python for up to a few milliseconds a step: the interpreter's
    switch interval (5 ms by default) is lowered to SWITCH_INTERVAL_S, so that the next
    step's call waits at most that long for it."""

    SWITCH_INTERVAL_S = 5e-4

    def __init__(self, name: str = "qwen-jax-dispatch"):
        if sys.getswitchinterval() > self.SWITCH_INTERVAL_S:
            sys.setswitchinterval(self.SWITCH_INTERVAL_S)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], object]):
        """fn() on this thread, after every call submitted before it; waits for it."""
        return self.submit(fn).result()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller's result() raises it
                future.set_exception(exc)


def done(fn: Callable[[], object]) -> concurrent.futures.Future:
    """fn() run now, as a finished future (what the dispatch thread's submit returns)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(fn())
    return future
