"""The reference MoE's CPU paths agree: per-block weight reads (mid-size batches) give what
one weight read per (token, slot) pair gives, whatever the routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax.moe import block_rows, experts_blocked, experts_gathered


@pytest.mark.parametrize("num_tokens,top_k,num_experts,routing", [
    (16, 2, 8, "random"), (64, 2, 8, "random"), (257, 2, 8, "random"),
    (100, 8, 128, "random"), (64, 2, 8, "one expert"), (40, 4, 8, "two experts")])
def test_blocked_experts_equal_per_pair_experts(num_tokens, top_k, num_experts, routing):
    rng = np.random.default_rng(num_tokens)
    dim, ffn = 16, 12
    x = jnp.asarray(rng.normal(size=(num_tokens, dim)).astype(np.float32))
    ids = rng.integers(0, num_experts, (num_tokens, top_k))
    if routing == "one expert":
        ids[:] = 5
    elif routing == "two experts":
        ids = ids % 2 + num_experts - 2
    gate_up = jnp.asarray(rng.normal(size=(num_experts, dim, 2 * ffn)).astype(np.float32))
    down = jnp.asarray(rng.normal(size=(num_experts, ffn, dim)).astype(np.float32))
    ids = jnp.asarray(ids.astype(np.int32))
    blocked = jax.jit(experts_blocked, static_argnums=4)(x, ids, gate_up, down, top_k)
    per_pair = jax.jit(experts_gathered, static_argnums=4)(x, ids, gate_up, down, top_k)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(per_pair), rtol=1e-6, atol=1e-5)
    # fewer weight reads than pairs: the point of the blocks
    pairs = num_tokens * top_k
    assert pairs // block_rows(pairs, num_experts) + num_experts < pairs
