from pallas_kernels.stacked_matmul.kernel import stacked_matmul
from pallas_kernels.stacked_matmul.reference import stacked_matmul_reference

__all__ = ["stacked_matmul", "stacked_matmul_reference"]
