"""One host-to-device transfer per step: a pytree of small host arrays packed into a single
int32 buffer, unpacked inside the jitted step by static offsets.

Every leaf is 32 bits wide (int32, uint32, float32) or a bool; floats and unsigned ints
travel bit for bit (a view on the host, `bitcast_convert_type` on the device), bools as
0/1. The layout is a function of the leaves' shapes alone, so one compiled step reads
every batch of its bucket.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)


def _as_words(leaf) -> np.ndarray:
    array = np.asarray(leaf)
    if array.dtype == np.bool_:
        array = array.astype(np.int32)
    if array.dtype.itemsize != 4:
        raise TypeError(f"cannot pack a {array.dtype} array: leaves must be 32-bit or bool")
    return np.ascontiguousarray(array).reshape(-1).view(_WORD)


def pack(tree) -> np.ndarray:
    """The tree's leaves, flattened in tree order, as one int32[N] host array."""
    leaves = jax.tree.leaves(tree)
    return np.concatenate([_as_words(leaf) for leaf in leaves]) if leaves else np.zeros(
        0, np.int32)


def packed_size(template) -> int:
    """Words `pack` makes of a tree shaped like `template` (arrays or ShapeDtypeStructs)."""
    return sum(int(np.prod(np.shape(leaf), dtype=np.int64))
               for leaf in jax.tree.leaves(template))


def unpack(words: jax.Array, template):
    """Inside jit: the tree `pack` made, leaves of `template`'s shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(template)
    out, offset = [], 0
    for leaf in leaves:
        shape, dtype = np.shape(leaf), np.dtype(leaf.dtype)
        size = int(np.prod(shape, dtype=np.int64))
        chunk = jax.lax.slice_in_dim(words, offset, offset + size).reshape(shape)
        offset += size
        if dtype == np.bool_:
            chunk = chunk != 0
        elif dtype != _WORD:
            chunk = jax.lax.bitcast_convert_type(chunk, jnp.dtype(dtype))
        out.append(chunk)
    return jax.tree.unflatten(treedef, out)
