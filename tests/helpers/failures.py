"""Failures injected into an engine's runner, one of each kind the server must tell apart."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


def fail_device_step(engine, after_steps: int = 0) -> None:
    """From step `after_steps + 1` on, the step raises having consumed the donated KV cache,
    as a failed XLA call does: the device state is gone."""
    real = engine.runner.execute
    calls = {"n": 0}

    def execute(inputs, sampling):
        calls["n"] += 1
        if calls["n"] <= after_steps:
            return real(inputs, sampling)
        for buffer in jax.tree.leaves(engine.runner.kv_caches):
            buffer.delete()
        raise RuntimeError("injected: the XLA step failed on the device")

    engine.runner.execute = execute


def corrupt_token_after(engine, marker: int, bad_token: int = -7):
    """Rows whose last input token is `marker` get `bad_token` sampled (one request's bad
    value coming back from the device; the cache is intact). Returns the undo function."""
    real = engine.runner.execute

    def execute(inputs, sampling):
        out = real(inputs, sampling)
        last = np.asarray(inputs.token_ids)[np.asarray(inputs.logits_index)]
        ids = np.where(last == marker, bad_token, np.asarray(out.token_ids))
        return dataclasses.replace(out, token_ids=ids)

    engine.runner.execute = execute
    return lambda: setattr(engine.runner, "execute", real)
