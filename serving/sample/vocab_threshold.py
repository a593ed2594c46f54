"""Top-k and top-p over a whole vocabulary without sorting it.

What the sampler's candidates cannot decide (top-p's mass spread over more tokens than
they hold, as in a flat distribution; a top-k past them) used to sort every row of the
vocabulary: on CPU ~100x the lm-head matmul at Qwen3's 151,936 tokens, and on a GPU a
sort of [rows, vocab] keys and ids. Here each threshold is a radix select instead: built
one bit at a time from the top, each bit one pass over the row (a count, or a masked
sum), 32 passes for a logit and 30 for a probability. Each row's result depends on that
row alone.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

_PROBABILITY_BITS = 30  # float32 in [0, 1]: bit patterns below 2^30 (1.0 is 0x3F800000)


def order_key(x):
    """f32 -> u32 in the same order (-inf lowest, -0.0 below 0.0 as `lax.top_k` has them;
    for values that are not NaN)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def largest_where(holds: Callable, num_bits: int, num_rows: int):
    """u32[R]: per row the largest t below 2^num_bits with holds(t) (bool[R] of u32[R]),
    for a `holds` that is true at 0 and stays false once it turns false (monotone). One
    bit a pass: testing three candidates a pass (two bits) cost three passes on CPU."""
    def one_bit(i, t):
        candidate = t | (jnp.uint32(1) << (num_bits - 1 - i).astype(jnp.uint32))
        return jnp.where(holds(candidate), candidate, t)

    return jax.lax.fori_loop(0, num_bits, one_bit, jnp.zeros(num_rows, jnp.uint32))


def top_k_mask(x, k):
    """bool[R, V]: each row's k largest entries of x (f32[R, V]), ties broken towards the
    lower id as `lax.top_k` breaks them; every entry where k <= 0 or k >= V."""
    num_rows, vocab = x.shape
    key = order_key(x)
    k = k.astype(jnp.int32)
    # the k-th largest key: the largest t with at least k keys >= t
    kth = largest_where(lambda t: jnp.sum(key >= t[:, None], axis=-1, dtype=jnp.int32) >= k,
                        32, num_rows)[:, None]
    above = key > kth
    ties = key == kth
    room = k[:, None] - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    keep = above | (ties & (jnp.cumsum(ties, axis=-1, dtype=jnp.int32) <= room))
    return keep | ((k <= 0) | (k >= vocab))[:, None]


def top_p_mask(r, top_p):
    """bool[R, V]: what top-p keeps of rows whose tokens have the weights r (f32[R, V] in
    [0, 1]: probabilities times a row's constant). A token stays when the tokens more
    likely than it hold less than top_p of the row's weight: the smallest set of the most
    likely tokens that holds top_p, a tie at its edge kept whole. The edge is the largest
    weight t for which the tokens of weight >= t still hold top_p (their sum in float32,
    which never grows as t does)."""
    bits = jax.lax.bitcast_convert_type(r, jnp.uint32)  # non-negative: in value order
    target = top_p * jnp.sum(r, axis=-1)
    edge = largest_where(
        lambda t: jnp.sum(jnp.where(bits >= t[:, None], r, 0.0), axis=-1) >= target,
        _PROBABILITY_BITS, r.shape[0])
    return bits >= edge[:, None]
