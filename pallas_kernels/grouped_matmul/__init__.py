from pallas_kernels.grouped_matmul.kernel import grouped_matmul
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference

__all__ = ["grouped_matmul", "grouped_matmul_reference"]
