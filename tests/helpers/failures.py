"""Failures injected into an engine's runner, one of each kind the server must tell apart."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


def fail_device_step(engine, after_steps: int = 0) -> None:
    """From step `after_steps + 1` on, the step raises having consumed the donated KV cache,
    as a failed XLA call does: the device state is gone."""
    real = engine.runner.dispatch
    calls = {"n": 0}

    def dispatch(inputs, sampling, prev=None, score_rows=None):
        calls["n"] += 1
        if calls["n"] <= after_steps:
            return real(inputs, sampling, prev, score_rows)
        for buffer in jax.tree.leaves(engine.runner.kv_caches):
            buffer.delete()
        raise RuntimeError("injected: the XLA step failed on the device")

    engine.runner.dispatch = dispatch


def corrupt_token_after(engine, marker: int, bad_token: int = -7):
    """Rows whose last input token is `marker` get `bad_token` sampled (one request's bad
    value coming back from the device; the cache is intact). Returns the undo function."""
    real = engine.runner.dispatch

    def dispatch(inputs, sampling, prev=None, score_rows=None):
        pending = real(inputs, sampling, prev, score_rows)
        result = pending.result

        def corrupted():
            # A token the previous step sampled is only on the device: read it from there.
            ids = np.asarray(inputs.token_ids).copy()
            from_prev = np.asarray(inputs.prev_index) >= 0
            if from_prev.any():
                ids[from_prev] = np.asarray(prev.next_tokens)[inputs.prev_index[from_prev]]
            last = ids[np.asarray(inputs.logits_index)]
            out = result()
            return dataclasses.replace(out, token_ids=np.where(
                last == marker, bad_token, np.asarray(out.token_ids)))

        pending.result = corrupted
        return pending

    engine.runner.dispatch = dispatch
    return lambda: setattr(engine.runner, "dispatch", real)
