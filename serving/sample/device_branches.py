"""Branches of the sampler, by platform. On the CPU a branch no row needs is skipped with
`lax.cond`. Elsewhere each cond a step executes costs a round trip: a GPU copies the
predicate back to the host, which waits for the device to get there and then queues the
branch (XLA's ConditionalThunk). So there a branch of a pass or two over [S, V] runs
always and a select keeps what the predicate picks (`skippable`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Tests set BRANCH_FREE_ON_CPU to run the other platforms' form on the CPU.
BRANCH_FREE_ON_CPU = False


def cpu_else(cpu, other):
    """cpu() where the sampler runs on a CPU, other() elsewhere."""
    if BRANCH_FREE_ON_CPU:
        return other()
    return jax.lax.platform_dependent(cpu=cpu, default=other)


def skippable(pred, true_fn, false_fn):
    """lax.cond(pred, true_fn, false_fn) on the CPU; elsewhere both and a select."""
    return cpu_else(
        lambda: jax.lax.cond(pred, true_fn, false_fn),
        lambda: jax.tree.map(functools.partial(jnp.where, pred), true_fn(), false_fn()))
