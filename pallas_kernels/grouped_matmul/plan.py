"""The work plan of a grouped matmul: which row tiles each group visits.

Built once per MoE layer in XLA and shared by the gate/up and down calls; each kernel
program finds its own (group, tile) from it (see kernel.py), so the plan costs one
small cumulative sum and no gathers.
"""

import dataclasses

import jax
import jax.numpy as jnp

# Past any work item id: the padding of `tiles_cum` (no item falls in a padded segment).
NO_ITEM = 2**30


def plan_width(num_groups: int) -> int:
    """Entries of `tiles_cum`: G + 1 rounded up to a power of two. The kernel loads them
    all as one vector (Triton vectors are powers of two), and a load past a ref's end
    fails to trace from jax 0.12 on (0.11 skipped the bounds check for a start of 0), so
    the plan holds them all."""
    return 1 << num_groups.bit_length()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Groups as cumulative row ends, and the work items of each segment.

    Segments are the G groups plus one padding segment (rows past the last group's end,
    written as zeros). A segment spanning row tiles a..b needs b - a + 1 work items.
    """

    ends: jax.Array       # int32[G]: row where each group ends, clipped to num_rows
    # int32[plan_width(G)]: work items of segments 0..s cumulated (G + 1 of them), then
    # NO_ITEM up to the power of two the kernel loads.
    tiles_cum: jax.Array
    num_rows: int = dataclasses.field(metadata=dict(static=True))
    block_m: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_groups(self) -> int:
        return self.ends.shape[0]

    @property
    def num_items(self) -> int:
        """Work items that cover any split: every row tile once, plus one more for each
        non-empty segment (at most min(G, rows) groups and the padding segment)."""
        return -(-self.num_rows // self.block_m) + min(self.num_groups, self.num_rows) + 1

    @property
    def group_sizes(self) -> jax.Array:
        """int32[G] rows per group (elementwise from the ends)."""
        return self.ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), self.ends[:-1]])


def plan_groups(ends, *, num_rows: int, block_m: int) -> GroupPlan:
    """ends: int32[G] cumulative group ends (non-decreasing) -> GroupPlan."""
    ends = jnp.minimum(ends.astype(jnp.int32), num_rows)
    seg_end = jnp.append(ends, num_rows)                                   # [G+1]
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])        # [G+1]
    tiles = jnp.where(seg_end > seg_start,
                      (seg_end - 1) // block_m - seg_start // block_m + 1, 0)
    tiles_cum = jnp.cumsum(tiles).astype(jnp.int32)                        # [G+1]
    pad = plan_width(ends.shape[0]) - tiles_cum.shape[0]
    tiles_cum = jnp.pad(tiles_cum, (0, pad), constant_values=NO_ITEM)      # [width]
    return GroupPlan(ends=ends, tiles_cum=tiles_cum, num_rows=num_rows, block_m=block_m)


def group_ends_of(group_sizes, num_rows: int):
    """int32[G] sizes -> int32[G] cumulative ends clipped to num_rows."""
    return jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows).astype(jnp.int32)
