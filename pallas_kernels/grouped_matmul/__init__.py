from pallas_kernels.grouped_matmul.kernel import grouped_matmul
from pallas_kernels.grouped_matmul.plan import GroupPlan, group_ends_of, plan_groups
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference

__all__ = ["GroupPlan", "group_ends_of", "grouped_matmul", "grouped_matmul_reference",
           "plan_groups"]
