"""The sampler's random draws: a counter-based hash of (seed, output index, counter), and
from it Gumbel noise and an exact draw from a row's softmax.

A hash rather than jax.random: threefry's unrolled rounds cost seconds of compile per
bucket on CPU, and the stream only has to be reproducible. Counters below 2^31 are token
ids (the noise a token gets is the same in every path); `_DRAW_COUNTERS` and up are
`softmax_draw`'s.
"""

from __future__ import annotations

import jax.numpy as jnp

from serving.sample.vocab_blocks import to_blocks

DRAW_BLOCK = 128  # tokens per block of `softmax_draw` (Qwen3's 151,936 = 1,187 blocks)
_DRAW_COUNTERS = 1 << 31


def _mix32(x):
    """A 32-bit integer hash (lowbias32): cheap to compile, well mixed."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise_at(seed, output_index, counters):
    """Gumbel(0, 1) noise f32[S, K] for these counters (int[S, K] or [1, K]; token ids) of
    each row: a pure function of (seed, output index, counter)."""
    row = _mix32(seed.astype(jnp.uint32) ^ _mix32(output_index.astype(jnp.uint32)
                                                  + jnp.uint32(0x9E3779B9)))  # [S]
    bits = _mix32(row[:, None] ^ _mix32(counters.astype(jnp.uint32)))
    return -jnp.log(-jnp.log(uniform_from_bits(bits)))


def uniform_from_bits(bits):
    """u32 -> f32 strictly inside (0, 1). 23 bits: with 24, (2^24 - 0.5) / 2^24 rounds to
    1.0 in float32, whose noise is +inf: that token would win whatever its logit (about
    one draw in a hundred over a 151k vocabulary), and a masked one would give NaN."""
    return ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def softmax_draw(scaled, seed, output_index):
    """A token per row drawn from softmax(scaled): i32[R].

    In two Gumbel-max draws instead of noise over every token: a block of DRAW_BLOCK
    tokens with probability its share of the mass (noise on each block's log-mass), then
    a token of that block with probability its share of the block (noise on its tokens'
    positions within the block). The two take distinct counters, so they are independent
    and the token's probability is (block mass / total) * (its mass / block mass). The
    vocabulary is read twice (max, then exp and block sums), with no hash or log per
    token. A vocabulary of a few blocks takes Gumbel-max over its tokens (noise by id)."""
    vocab = scaled.shape[-1]
    if vocab <= 4 * DRAW_BLOCK:
        noise = gumbel_noise_at(seed, output_index, jnp.arange(vocab)[None, :])
        return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
    blocks = to_blocks(scaled, DRAW_BLOCK)  # [R, NB, W]
    num_blocks = blocks.shape[1]
    counters = jnp.arange(num_blocks + DRAW_BLOCK, dtype=jnp.uint32) + jnp.uint32(_DRAW_COUNTERS)
    noise = gumbel_noise_at(seed, output_index, counters[None, :])  # [R, NB + W]
    top = jnp.max(scaled, axis=-1)  # [R]
    log_mass = jnp.log(jnp.sum(jnp.exp(blocks - top[:, None, None]), axis=-1))  # [R, NB]
    block = jnp.argmax(log_mass + noise[:, :num_blocks], axis=-1)  # [R]
    within = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [R, W]
    pick = jnp.argmax(within + noise[:, num_blocks:], axis=-1)
    return (block * DRAW_BLOCK + pick).astype(jnp.int32)


def gumbel_max(kept, ids, seed, output_index):
    """Gumbel-max over kept logits f32[R, K] (-inf: dropped) of tokens ids int[R, K]: the
    noise is attached to the token id, not the position, so the draw does not depend on
    the order (or ties) in which a path lists its candidates."""
    choice = jnp.argmax(kept + gumbel_noise_at(seed, output_index, ids), axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
