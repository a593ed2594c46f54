"""The `impl` switch: which implementation of every op runs.

- "pallas" (the GPU default): the Triton-backed Pallas kernels, every op and step kind
  (bf16/fp16/fp32, fp8/int8/int4 weights, fp8/int8 pages). Triton is deprecated upstream
  (jax 0.11) but still the one backend that covers all of it.
- "mosaic": Mosaic GPU (Hopper TMA + WGMMA) kernels where they apply: the grouped
  matmul of prefill-sized groups (plan block_m >= 64) and prefill attention, in 16-bit
  floats; everything else (decode steps, quantised weights and pages, fp32, the stacked
  matmul) runs the Triton kernels, each `*_unsupported_reason` saying why. Opt-in until an
  H200 measures it faster; on jax 0.10 its attention is the Triton one
  (`pallas_kernels.mosaic_support`).
- "reference": the plain-jnp twins (the CPU default; the oracle of every kernel test).

`grouped_matmul_xla` (`jax.lax.ragged_dot`) is no impl: a candidate the device probe
times, which a kernel table (pallas_kernels/choices.py) may pick per size. On a CPU the
kernels run only interpreted (`interpreted`): Triton kernels by Pallas's interpreter,
Mosaic GPU kernels by the GPU interpreter.
"""

import dataclasses
import functools
from typing import Callable

import jax

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.grouped_matmul.mosaic import grouped_matmul_mosaic
from pallas_kernels.kv_write import write_kv_pages
from pallas_kernels.lora import lora_matmul, lora_matmul_reference
from pallas_kernels.ragged_paged_attention import (
    plan_attention,
    plan_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention.mosaic import (
    plan_attention_mosaic,
    ragged_paged_attention_mosaic,
)
from pallas_kernels.stacked_matmul import stacked_matmul, stacked_matmul_reference

IMPLS = ("pallas", "reference", "mosaic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ops:
    """The kernel entry points of one implementation; all share one signature per op."""
    impl: str
    ragged_paged_attention: Callable
    plan_attention: Callable
    grouped_matmul: Callable
    stacked_matmul: Callable
    write_kv_pages: Callable
    lora_matmul: Callable


def default_impl(backend=None):
    """"pallas" on GPU backends (the Triton kernels compile there), else "reference";
    "mosaic" only when asked for."""
    backend = backend or jax.default_backend()
    return "pallas" if backend in ("gpu", "cuda") else "reference"


def ops(impl=None):
    """The ops for `impl` ("pallas" | "reference" | "mosaic"; None: `default_impl()`)."""
    impl = impl or default_impl()
    if impl == "pallas":
        return Ops(impl=impl, ragged_paged_attention=ragged_paged_attention,
                   plan_attention=plan_attention, grouped_matmul=grouped_matmul,
                   stacked_matmul=stacked_matmul, write_kv_pages=write_kv_pages,
                   lora_matmul=functools.partial(lora_matmul, gmm=grouped_matmul))
    if impl == "mosaic":
        return Ops(impl=impl, ragged_paged_attention=ragged_paged_attention_mosaic,
                   plan_attention=plan_attention_mosaic, grouped_matmul=grouped_matmul_mosaic,
                   stacked_matmul=stacked_matmul, write_kv_pages=write_kv_pages,
                   lora_matmul=functools.partial(lora_matmul, gmm=grouped_matmul_mosaic))
    if impl == "reference":
        return Ops(impl=impl, ragged_paged_attention=ragged_paged_attention_reference,
                   plan_attention=plan_attention_reference,
                   grouped_matmul=grouped_matmul_reference,
                   stacked_matmul=stacked_matmul_reference, write_kv_pages=write_kv_pages,
                   lora_matmul=lora_matmul_reference)
    raise ValueError(f"impl is {impl!r}, expected one of {IMPLS}")


def interpreted(kernels: Ops) -> Ops:
    """The same ops with every Pallas kernel run by the CPU interpreter (interpret=True:
    Triton kernels by Pallas's, Mosaic GPU kernels by the GPU interpreter)."""
    if kernels.impl not in ("pallas", "mosaic"):
        return kernels
    run = lambda fn: functools.partial(fn, interpret=True)
    return dataclasses.replace(
        kernels, ragged_paged_attention=run(kernels.ragged_paged_attention),
        grouped_matmul=run(kernels.grouped_matmul), stacked_matmul=run(kernels.stacked_matmul),
        lora_matmul=run(kernels.lora_matmul))
