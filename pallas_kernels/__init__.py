"""Pallas GPU kernels for the serving engine, each with a plain-jnp reference twin."""

from pallas_kernels.grouped_matmul import grouped_matmul_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

__all__ = ["grouped_matmul_reference", "ragged_paged_attention_reference"]
