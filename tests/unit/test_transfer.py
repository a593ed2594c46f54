"""One packed host-to-device buffer per step: pack on the host, unpack in jit, bit exact."""

import jax
import numpy as np
import pytest

from serving.executor.transfer import pack, packed_size, unpack


def test_pack_unpack_round_trips_every_leaf_bit_for_bit():
    rng = np.random.default_rng(0)
    tree = {"ids": rng.integers(-5, 9, (3, 4)).astype(np.int32),
            "temperature": rng.random(5).astype(np.float32),
            "seed": np.array([0, 2**32 - 1, 12345], np.uint32),
            "nan": np.array([np.nan, -0.0, np.inf], np.float32),
            "flag": np.array(True), "count": np.array(7, np.int32)}
    words = pack(tree)
    assert words.dtype == np.int32
    assert words.shape == (packed_size(tree),) == (12 + 5 + 3 + 3 + 1 + 1,)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    out = jax.device_get(jax.jit(lambda w: unpack(w, template))(words))
    for name, leaf in tree.items():
        assert out[name].dtype == leaf.dtype and out[name].shape == leaf.shape, name
        assert out[name].tobytes() == leaf.tobytes(), name


def test_pack_rejects_leaves_that_are_not_32_bit():
    with pytest.raises(TypeError, match="float64"):
        pack({"x": np.zeros(3, np.float64)})
