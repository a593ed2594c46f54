from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.plan import AttentionPlan, plan_attention
from pallas_kernels.ragged_paged_attention.reference import (
                                                             ReferencePlan,
                                                             plan_attention_reference,
                                                             ragged_paged_attention_reference,
)

__all__ = ["AttentionPlan", "ReferencePlan", "plan_attention", "plan_attention_reference",
           "ragged_paged_attention", "ragged_paged_attention_reference"]
