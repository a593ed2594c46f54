"""Pallas GPU kernels for the serving engine, each with a plain-jnp reference twin.

`ops(impl)` picks one implementation of every op; `default_impl()` is "pallas" on GPU
backends and "reference" elsewhere.
"""

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.impl import IMPLS, Ops, default_impl, ops
from pallas_kernels.kv_write import quantize, write_kv_pages
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "IMPLS", "Ops", "default_impl", "grouped_matmul", "grouped_matmul_reference", "ops",
    "quantize", "ragged_paged_attention", "ragged_paged_attention_reference",
    "write_kv_pages",
]
