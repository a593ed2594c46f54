from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference"]
