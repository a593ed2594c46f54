"""Writing a step's new keys and values into their page slots.

An XLA scatter on the flattened [P * L, K, H] view: with the cache donated XLA updates
it in place, and each slot row is a contiguous K * H copy, so a Pallas kernel has
little to win here (see docs/architecture.md, "Kernels").
"""

import jax.numpy as jnp
from jax.typing import ArrayLike

from pallas_kernels.array_types import Array, Float, Int, Shaped

_INT8_MAX = 127.0


def quantize(values, pages_dtype, scale):
    """float [..., K, H] -> pages_dtype, divided by the per-kv-head scale float32[K]."""
    if scale is None:
        return values.astype(pages_dtype)
    scaled = values.astype(jnp.float32) / scale.astype(jnp.float32)[:, None]
    if jnp.issubdtype(pages_dtype, jnp.integer):
        return jnp.clip(jnp.round(scaled), -_INT8_MAX, _INT8_MAX).astype(pages_dtype)
    # fp8 casts turn out-of-range values into NaN; saturate instead.
    limit = float(jnp.finfo(pages_dtype).max)
    return jnp.clip(scaled, -limit, limit).astype(pages_dtype)


def write_kv_pages(k_pages: Shaped[ArrayLike, "P L K H"], v_pages: Shaped[ArrayLike, "P L K H"],
                   k_new: Float[ArrayLike, "T K H"], v_new: Float[ArrayLike, "T K H"],
                   slot_mapping: Int[ArrayLike, " T"], *,
                   k_scale: Float[ArrayLike, " K"] | None = None,
                   v_scale: Float[ArrayLike, " K"] | None = None
                   ) -> tuple[Shaped[Array, "P L K H"], Shaped[Array, "P L K H"]]:
    """Scatter new rows into the paged cache; returns the updated (k_pages, v_pages).

    k_pages, v_pages: [P, L, K, H]; k_new, v_new: [T, K, H]; slot_mapping: int32[T]
    with slot = page * L + offset, negative for padding tokens (they are dropped).
    k_scale, v_scale: float32[K] when the pages hold fp8/int8 (values are divided by them).
    """
    k_pages, v_pages, k_new, v_new, slot_mapping = map(
        jnp.asarray, (k_pages, v_pages, k_new, v_new, slot_mapping))
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    if k_new.shape != v_new.shape or k_new.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k_new/v_new have shapes {tuple(k_new.shape)}/"
                         f"{tuple(v_new.shape)}, expected [T, {num_kv_heads}, {head_dim}]")
    if slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected "
                         f"({k_new.shape[0]},), one slot per new token")
    num_slots = num_pages * page_size
    # Negative slots would wrap around; send them past the end, where mode="drop" skips.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def scatter(pages, new, scale):
        flat = pages.reshape(num_slots, num_kv_heads, head_dim)          # [P*L, K, H]
        flat = flat.at[slots].set(quantize(new, pages.dtype, scale), mode="drop")
        return flat.reshape(pages.shape)

    return scatter(k_pages, k_new, k_scale), scatter(v_pages, v_new, v_scale)

