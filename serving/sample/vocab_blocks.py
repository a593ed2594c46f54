"""Argmax and top-k over the vocabulary through the maxima of blocks of tokens.

On CPU, XLA's argmax (a two-operand reduce) costs about three times a max, and its TopK
partially sorts every entry of a row; a max over blocks is one vectorised read. Both
give exactly what `jnp.argmax` and `lax.top_k` give, ties included (the lower id first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ARGMAX_BLOCK = 128  # tokens per block of `block_argmax` (Qwen3's 151,936 = 1,187 blocks)
TOP_K_BLOCKS = (128, 16)  # `block_top_k`'s block widths: blocks of tokens, then of those


def to_blocks(x, width: int):
    """f32[R, V] -> f32[R, ceil(V / width), width], -inf past the vocabulary."""
    num_rows, vocab = x.shape
    padded = -(-vocab // width) * width
    if padded != vocab:
        x = jnp.pad(x, ((0, 0), (0, padded - vocab)), constant_values=-jnp.inf)
    return x.reshape(num_rows, padded // width, width)


def block_argmax(x):
    """`jnp.argmax(x, axis=-1)` as i32[R] (for rows without NaN, which a block's max may
    skip): the first block holding the maximum, then the first maximum within it. Plain
    argmax where the vocabulary is small or no multiple of the block (no padded copy)."""
    if x.shape[-1] % ARGMAX_BLOCK or x.shape[-1] < 8 * ARGMAX_BLOCK:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = to_blocks(x, ARGMAX_BLOCK)  # [R, NB, W]
    block = jnp.argmax(blocks.max(axis=-1), axis=-1)  # [R]
    within = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [R, W]
    return (block * ARGMAX_BLOCK + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def block_top_k(x, k: int, divisor=None):
    """`jax.lax.top_k(x, k)`: the same values and ids in the same order (ties: lower id
    first). The k largest entries lie in the k blocks with the highest maxima (ties:
    lower block first), so each level keeps only those blocks, in id order, and the
    last top_k searches what is left (k * 16 entries instead of the vocabulary). Plain
    top_k where the blocks would not save much (k * 128 over a quarter of the entries).

    divisor: f32[R, 1] > 0 or None: the top k of `x / divisor` without dividing all of x.
    Dividing by a positive number never reorders (x <= y gives x / d <= y / d, rounded
    too), so a block's maximum divided is the maximum of its entries divided: the first
    level reads x and divides its maxima and the entries it keeps, and every value and
    tie is the one over x / divisor."""
    values, ids = x, None  # ids: each entry's id (None: its position)
    if k * TOP_K_BLOCKS[0] <= x.shape[-1] // 4:
        for width in TOP_K_BLOCKS:
            values, kept = _best_blocks(values, k, width, divisor)
            divisor = None  # the kept entries are divided
            ids = kept if ids is None else jnp.take_along_axis(ids, kept, axis=-1)
    elif divisor is not None:
        values = values / divisor
    top, index = jax.lax.top_k(values, k)
    return top, index if ids is None else jnp.take_along_axis(ids, index, axis=-1)


def _best_blocks(values, k: int, width: int, divisor=None):
    """The entries f32[R, k * width] of the k blocks of `width` with the highest maxima,
    in the order they had, and their positions i32[R, k * width] in `values` (past its
    end: -inf padding, after every real entry in ties); with a divisor, the maxima and
    the kept entries divided by it."""
    blocks = to_blocks(values, width)  # [R, NB, W]
    maxima = blocks.max(axis=-1)
    _, best = jax.lax.top_k(maxima if divisor is None else maxima / divisor, k)
    best = jnp.sort(best, axis=-1)[:, :, None]  # [R, k, 1] ascending: kept in id order
    kept = jnp.take_along_axis(blocks, best, axis=1).reshape(values.shape[0], k * width)
    positions = best * width + jnp.arange(width, dtype=best.dtype)
    return (kept if divisor is None else kept / divisor,
            positions.reshape(values.shape[0], k * width))
