"""Pallas GPU kernels for the serving engine, each with a plain-jnp reference twin.

`ops(impl)` picks one implementation of every op (impl.py says which runs where);
`default_impl()` is "pallas" (Triton kernels) on GPU backends and "reference" elsewhere.
Mosaic GPU variants sit beside the Triton kernels (`<op>/mosaic.py`), an XLA ragged_dot
grouped matmul in grouped_matmul/xla.py; cuda_lowering.py lowers any of them for CUDA
on a machine without a GPU.
"""

from pallas_kernels.grouped_matmul import (
                                           GroupPlan,
                                           grouped_matmul,
                                           grouped_matmul_reference,
                                           plan_groups,
)
from pallas_kernels.impl import IMPLS, Ops, default_impl, interpreted, ops
from pallas_kernels.kv_write import quantize, write_kv_pages
from pallas_kernels.ragged_paged_attention import (
                                           AttentionPlan,
                                           ReferencePlan,
                                           plan_attention,
                                           plan_attention_reference,
                                           ragged_paged_attention,
                                           ragged_paged_attention_reference,
)
from pallas_kernels.stacked_matmul import stacked_matmul, stacked_matmul_reference

__all__ = [
    "IMPLS", "AttentionPlan", "GroupPlan", "Ops", "ReferencePlan", "default_impl",
    "grouped_matmul", "grouped_matmul_reference", "interpreted", "ops", "plan_attention",
    "plan_attention_reference", "plan_groups", "quantize", "ragged_paged_attention",
    "ragged_paged_attention_reference", "stacked_matmul", "stacked_matmul_reference",
    "write_kv_pages",
]
