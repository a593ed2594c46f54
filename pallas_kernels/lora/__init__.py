"""Multi-LoRA matmul: each row adds its own adapter's low-rank update, x @ A[g] @ B[g].

Rows carry a group id (an adapter slot, or an (adapter, expert) pair for the MoE
experts); `num_groups` is the sentinel of rows with no adapter. The kernel path is
punica's shrink / expand (vLLM's `lora_shrink` / `lora_expand`) written as two grouped
matmuls over the rows sorted by group: the grouped-matmul kernels of the chosen impl
(Triton or Mosaic GPU), one plan for both calls, sentinel rows sorted last where the
kernels write zeros and do no work. The reference twin, with the same signature,
gathers each row's factors (what runs on a CPU, where ragged_dot computes every group).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.array_types import Array, Float, Int
from pallas_kernels.grouped_matmul import grouped_matmul, plan_groups
from pallas_kernels.grouped_matmul import tuning as gmm_tuning
from pallas_kernels.grouped_matmul.plan import GroupPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAGroups:
    """Rows' groups and their sorted order, built once and shared by every matmul of
    those rows (all layers of a step for the dense ones)."""

    ids: jax.Array    # int32[M] group of each row; num_groups: no adapter
    order: jax.Array  # int32[M] rows sorted by group (stable), no-adapter rows last
    plan: GroupPlan   # the grouped matmuls' plan over the sorted rows
    active: jax.Array  # bool[]: some row has an adapter

    @property
    def num_groups(self) -> int:
        return self.plan.num_groups


def lora_groups(ids: Int[Array, " M"], num_groups: int) -> LoRAGroups:
    """ids: int32[M] in 0..num_groups (num_groups: the row has no adapter)."""
    ids = ids.astype(jnp.int32)
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    groups = jnp.arange(num_groups, dtype=jnp.int32)
    ends = jnp.sum(ids[:, None] <= groups[None, :], axis=0, dtype=jnp.int32)  # [G]
    num_rows = ids.shape[0]
    block_m = gmm_tuning.block_m_for(num_rows=num_rows, num_groups=num_groups)
    plan = plan_groups(ends, num_rows=num_rows, block_m=block_m)
    return LoRAGroups(ids=ids, order=order, plan=plan, active=jnp.any(ids < num_groups))


def lora_matmul(x: Float[Array, "M K"], a: Float[Array, "X G K R"],
                b: Float[Array, "X G R N"], layer, groups: LoRAGroups, *, lhs_rows=None,
                out_rows=None, gmm=None, interpret: bool = False) -> Float[Array, "M N"]:
    """Row m of the result is x[m] @ a[layer, g] @ b[layer, g] with g = groups.ids[m],
    zero for rows without an adapter; fp32 accumulation, output in x's dtype.
    lhs_rows: int32[M], row m reads x[lhs_rows[m]] in place (x may then have any rows);
    out_rows: int32[M], a permutation: row m is stored at out[out_rows[m]].
    gmm: the grouped matmul to use (default: the Triton kernel)."""
    gmm = gmm or grouped_matmul
    kw = dict(plan=groups.plan, layer=layer, interpret=interpret)
    rows = groups.order if lhs_rows is None else lhs_rows[groups.order]
    shrunk = gmm(x, a, lhs_rows=rows, **kw)                 # [M, R], rows sorted by group
    out = groups.order if out_rows is None else out_rows[groups.order]
    return gmm(shrunk, b, out_rows=out, **kw)               # [M, N], rows back in place


# Up to this many columns (groups x rank) the reference multiplies every row by every
# group's A and masks (XLA dots, which shard under a mesh); past it (the experts' (adapter,
# expert) groups) it gathers each row's factors, the cheaper on a CPU there (docs/benchmarks.md,
# "Multi-LoRA").
DENSE_COLUMNS = 512


def lora_matmul_reference(x: Float[Array, "M K"], a: Float[Array, "X G K R"],
                          b: Float[Array, "X G R N"], layer, groups: LoRAGroups, *,
                          lhs_rows=None, out_rows=None, gmm=None, interpret: bool = False
                          ) -> Float[Array, "M N"]:
    """`lora_matmul` in plain jnp (gmm and interpret are accepted so it can stand in for
    the kernel path)."""
    del gmm, interpret
    if lhs_rows is not None:
        x = x[lhs_rows]
    out = _reference_rows(x, a, b, layer, groups)
    return out if out_rows is None else jnp.zeros_like(out).at[out_rows].set(out)


def _reference_rows(x, a, b, layer, groups: LoRAGroups):
    _, num_groups, depth, rank = a.shape
    hi = jax.lax.Precision.HIGHEST
    a, b = a[layer].astype(x.dtype), b[layer].astype(x.dtype)    # [G, K, R], [G, R, N]
    onehot = (groups.ids[:, None] == jnp.arange(num_groups)[None, :]).astype(x.dtype)
    if num_groups * rank <= DENSE_COLUMNS:
        a_all = jnp.transpose(a, (1, 0, 2)).reshape(depth, num_groups * rank)
        shrunk = jnp.einsum("mk,kc->mc", x, a_all, precision=hi,
                            preferred_element_type=jnp.float32).astype(x.dtype)
        shrunk = shrunk.reshape(-1, num_groups, rank) * onehot[:, :, None]   # [M, G, R]
        out = jnp.einsum("mgr,grn->mn", shrunk, b, precision=hi,
                         preferred_element_type=jnp.float32)
        return out.astype(x.dtype)
    has = groups.ids < num_groups
    g = jnp.where(has, groups.ids, 0)
    shrunk = jnp.einsum("mk,mkr->mr", x, a[g], precision=hi,
                        preferred_element_type=jnp.float32).astype(x.dtype)
    out = jnp.einsum("mr,mrn->mn", shrunk, b[g], precision=hi,
                     preferred_element_type=jnp.float32)
    return jnp.where(has[:, None], out, 0).astype(x.dtype)


__all__ = ["LoRAGroups", "lora_groups", "lora_matmul", "lora_matmul_reference"]
