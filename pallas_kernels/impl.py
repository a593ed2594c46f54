"""The `impl` switch: Pallas kernels on GPUs, the jnp references elsewhere."""

import dataclasses
import functools
from typing import Callable

import jax

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.kv_write import write_kv_pages
from pallas_kernels.ragged_paged_attention import (
    plan_attention,
    plan_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.stacked_matmul import stacked_matmul, stacked_matmul_reference

IMPLS = ("pallas", "reference")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ops:
    """The kernel entry points of one implementation; all share one signature per op."""
    impl: str
    ragged_paged_attention: Callable
    plan_attention: Callable
    grouped_matmul: Callable
    stacked_matmul: Callable
    write_kv_pages: Callable


def default_impl(backend=None):
    """"pallas" on GPU backends (the Triton kernels compile there), else "reference"."""
    backend = backend or jax.default_backend()
    return "pallas" if backend in ("gpu", "cuda") else "reference"


def ops(impl=None):
    """The ops for `impl` ("pallas" | "reference"; None picks `default_impl()`)."""
    impl = impl or default_impl()
    if impl == "pallas":
        return Ops(impl=impl, ragged_paged_attention=ragged_paged_attention,
                   plan_attention=plan_attention, grouped_matmul=grouped_matmul,
                   stacked_matmul=stacked_matmul, write_kv_pages=write_kv_pages)
    if impl == "reference":
        return Ops(impl=impl, ragged_paged_attention=ragged_paged_attention_reference,
                   plan_attention=plan_attention_reference,
                   grouped_matmul=grouped_matmul_reference,
                   stacked_matmul=stacked_matmul_reference, write_kv_pages=write_kv_pages)
    raise ValueError(f"impl is {impl!r}, expected one of {IMPLS}")


def interpreted(kernels: Ops) -> Ops:
    """The same ops with every Pallas kernel run by the CPU interpreter (interpret=True)."""
    if kernels.impl != "pallas":
        return kernels
    run = lambda fn: functools.partial(fn, interpret=True)
    return dataclasses.replace(
        kernels, ragged_paged_attention=run(kernels.ragged_paged_attention),
        grouped_matmul=run(kernels.grouped_matmul), stacked_matmul=run(kernels.stacked_matmul))
