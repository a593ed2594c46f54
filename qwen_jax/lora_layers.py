"""LoRA in the model: adapter slots preallocated in every layer, one update per step.

`enable_lora(model, num_slots, rank)` gives every stacked layer zeroed factor buffers of
`num_slots` adapters at rank `rank` ([X, S, ...]: layers, slots), which the engine fills
one slot at a time (serving/executor/lora_slots.py) from adapters packed by
qwen_jax/lora.py. A step's tokens each carry a slot (0: no adapter; s: buffer s - 1);
every projection then adds `lora_matmul` over the tokens grouped by slot, and the experts
over their (token, expert) pairs grouped by (slot, expert). Fused projections share one
pair of factors: q, k and v side by side in A and block-diagonal in B (3R), as gate and
up (2R); the zero blocks cost a few flops and save three calls.

Buffer layout (X layers, S slots, R rank; see qwen_jax/lora.py's `lora_buffer_shapes`):
  self_attn.lora_qkv_a [X, S, D, 3R]         self_attn.lora_qkv_b [X, S, 3R, (N+2K)H]
  self_attn.lora_o_a   [X, S, NH, R]         self_attn.lora_o_b   [X, S, R, D]
  dense mlp.lora_gate_up_a [X, S, D, 2R]     mlp.lora_gate_up_b [X, S, 2R, 2, F]
            mlp.lora_down_a [X, S, F, R]     mlp.lora_down_b [X, S, R, D]
  moe   mlp.lora_experts_gate_up_a [X, S, E, D, 2R]   ..._gate_up_b [X, S, E, 2R, 2, F]
        mlp.lora_experts_down_a    [X, S, E, F, R]    ..._down_b    [X, S, E, R, D]
The experts' buffers shard like their base weights (E over `expert`, F over `model`);
the others are replicated (their matmuls are XLA dots under a mesh).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.lora import LoRAGroups, lora_groups, lora_matmul_reference
from qwen_jax.lora_packing import lora_buffer_shapes

# Our names of the experts' buffers (qwen_jax/lora.py packs them as mlp.lora_gate_up_a ...
# in MoE segments too): the sharding table tells them apart by name.
EXPERT_NAMES = {"mlp.lora_gate_up_a": "mlp.lora_experts_gate_up_a",
                "mlp.lora_gate_up_b": "mlp.lora_experts_gate_up_b",
                "mlp.lora_down_a": "mlp.lora_experts_down_a",
                "mlp.lora_down_b": "mlp.lora_experts_down_b"}


class LoRAWeight(nnx.Variable):
    """A LoRA factor buffer: state the engine writes, not a trained Param."""


def buffer_shapes(cfg, rank: int) -> list[dict[str, tuple[int, ...]]]:
    """Per segment: buffer name (module.attribute) -> shape [X, ...] without the slot axis
    (qwen_jax/lora.py's layout, under our names)."""
    return [{(EXPERT_NAMES.get(name, name) if kind == "moe" else name): shape
             for name, shape in shapes.items()}
            for (kind, _, _), shapes in zip(cfg.segments, lora_buffer_shapes(cfg, rank))]


def with_slots(shape: tuple[int, ...], num_slots: int) -> tuple[int, ...]:
    """[X, ...] -> [X, S, ...]."""
    return (shape[0], num_slots, *shape[1:])


def enable_lora(model, num_slots: int, rank: int, *, abstract: bool = False) -> None:
    """Zeroed buffers for `num_slots` adapters of rank <= `rank` in every layer of
    `model` (created in their shards under the model's mesh; `abstract`: shapes only, for
    lowering without memory). Call before the state is split for the step."""
    from qwen_jax import sharding
    mesh = model.mesh
    for stack, shapes in zip(model.segments, buffer_shapes(model.config, rank)):
        for name, shape in shapes.items():
            module_name, attr = name.split(".")
            full = with_slots(shape, num_slots)
            target = None if mesh is None else jax.sharding.NamedSharding(
                mesh, sharding.spec_for(sharding.lora_logical_axes(attr), full, mesh))
            value = (jax.ShapeDtypeStruct(full, model.dtype, sharding=target) if abstract
                     else sharding.zeros(full, model.dtype, target))
            setattr(getattr(stack, module_name), attr, LoRAWeight(value))
    model.lora_slots = num_slots
    model.lora_rank = rank


def token_groups(slots, valid, num_slots: int) -> LoRAGroups:
    """slots: int32[T] (0: none, s: buffer s - 1); valid: bool[T] -> the tokens' groups."""
    ids = jnp.where(valid & (slots > 0), slots - 1, num_slots)
    return lora_groups(ids, num_slots)


def lora_op(rt):
    """The LoRA matmul of this forward: the impl's on one device; under a mesh the
    reference (XLA dots over the replicated factors, as `attention.matmul_op`)."""
    if rt.mesh is not None:
        return lora_matmul_reference
    return rt.kernels.lora_matmul


def add_lora(y, x, module, name: str, layer, groups: LoRAGroups | None, rt, *,
             xla: bool = False):
    """y + the LoRA update of module.<name>_a / _b for x's rows (y unchanged when the
    model has no LoRA buffers or the step no slots). A B of [.., 2, F] (gate and up)
    is read as [.., 2F]. xla: the plain-jnp op on every impl (the router's few columns,
    E, need not fit the kernels' tiles)."""
    a = getattr(module, f"{name}_a", None)
    if a is None or groups is None:
        return y
    b = getattr(module, f"{name}_b")[...]
    b = b.reshape(*b.shape[:3], -1)                           # [X, S, R', N]
    op = lora_matmul_reference if xla else lora_op(rt)
    a = a[...]
    return when_active(groups, rt, lambda: y + op(x, a, b, layer, groups), lambda: y)


def when_active(groups: LoRAGroups, rt, with_lora, without):
    """with_lora(), or without() when no row of the step has an adapter, by a lax.cond on
    the CPU's reference path (the reference computes every slot's update densely). The
    kernels skip rows without an adapter by themselves, and a GPU pays a round trip per
    cond: there, with_lora() always."""
    if rt.impl != "reference":
        return with_lora()
    return jax.lax.platform_dependent(
        cpu=lambda: jax.lax.cond(groups.active, with_lora, without), default=with_lora)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertLoRA:
    """The experts' factors of one stack and the tokens' slots, as the MoE block hands
    them to its (possibly sharded) expert computation."""

    token_ids: jax.Array   # int32[T]: buffer of each token's adapter, S for none
    gate_up_a: jax.Array   # [X, S, E, D, 2R]
    gate_up_b: jax.Array   # [X, S, E, 2R, 2, F]
    down_a: jax.Array      # [X, S, E, F, R]
    down_b: jax.Array      # [X, S, E, R, D]

    @classmethod
    def of(cls, module, groups: LoRAGroups | None) -> ExpertLoRA | None:
        if groups is None or getattr(module, "lora_experts_gate_up_a", None) is None:
            return None
        return cls(token_ids=groups.ids, gate_up_a=module.lora_experts_gate_up_a[...],
                   gate_up_b=module.lora_experts_gate_up_b[...],
                   down_a=module.lora_experts_down_a[...],
                   down_b=module.lora_experts_down_b[...])

    def specs(self, expert_spec, model_axis):
        """shard_map specs: experts over `expert_spec`, F over `model_axis`."""
        from jax.sharding import PartitionSpec as P
        return ExpertLoRA(token_ids=P(),
                          gate_up_a=P(None, None, expert_spec, None, None),
                          gate_up_b=P(None, None, expert_spec, None, None, model_axis),
                          down_a=P(None, None, expert_spec, model_axis, None),
                          down_b=P(None, None, expert_spec, None, None))

    def pair_groups(self, pairs, flat_ids, top_k: int) -> LoRAGroups:
        """pairs: int32[R] the (token, slot) pair of each row (M: none); flat_ids:
        int32[M] local expert of each pair (E_local: not here) -> groups (s * E_local + e)."""
        num_slots, num_local = self.gate_up_a.shape[1], self.gate_up_a.shape[2]
        num_pairs = flat_ids.shape[0]
        real = pairs < num_pairs
        pair = jnp.where(real, pairs, 0)
        slot, expert = self.token_ids[pair // top_k], flat_ids[pair]
        ok = real & (slot < num_slots) & (expert < num_local)
        ids = jnp.where(ok, slot * num_local + expert, num_slots * num_local)
        return lora_groups(ids, num_slots * num_local)

    def delta(self, which: str, lhs, layer, groups: LoRAGroups, op, lhs_rows=None,
              out_rows=None):
        """The update of the gate/up pair ("gate_up": lhs [*, D] -> [R, 2F]) or of down
        ("down": lhs [R, F] -> [R, D]) for the rows of `groups`."""
        a, b = ((self.gate_up_a, self.gate_up_b) if which == "gate_up"
                else (self.down_a, self.down_b))
        a = a.reshape(a.shape[0], -1, *a.shape[3:])           # [X, S*E, K, R']
        b = b.reshape(b.shape[0], a.shape[1], b.shape[3], -1)  # [X, S*E, R', N]
        return op(lhs, a, b, layer, groups, lhs_rows=lhs_rows, out_rows=out_rows)

    def hook(self, flat_ids, top_k: int, layer, op):
        """-> rows(pairs) -> delta(which, lhs, lhs_rows=None, out_rows=None): the updates
        for rows that are the (token, slot) pairs `pairs` (one grouping per call of rows)."""
        def rows(pairs):
            groups = self.pair_groups(pairs, flat_ids, top_k)
            return lambda which, lhs, lhs_rows=None, out_rows=None: self.delta(
                which, lhs, layer, groups, op, lhs_rows, out_rows)
        return rows


@functools.partial(jax.jit, donate_argnums=0)
def _set_slot(buffer, value, index):
    return buffer.at[:, index].set(value.astype(buffer.dtype))


def write_slot(model, index: int, packed: list[dict]) -> None:
    """Buffer `index` (a token slot of index + 1) of every layer <- an adapter packed by
    qwen_jax/lora.py's `pack_adapter` (per segment: name -> [X, ...]), in place (donated)."""
    if not 0 <= index < model.lora_slots:
        raise ValueError(f"LoRA buffer index is {index}, expected 0..{model.lora_slots - 1}")
    for stack, (kind, _, _), arrays in zip(model.segments, model.config.segments, packed):
        for name, value in arrays.items():
            name = EXPERT_NAMES.get(name, name) if kind == "moe" else name
            module_name, attr = name.split(".")
            var = getattr(getattr(stack, module_name), attr)
            buffer = var[...]
            if tuple(value.shape) != (buffer.shape[0], *buffer.shape[2:]):
                raise ValueError(f"packed LoRA {name} has shape {tuple(value.shape)}, expected "
                                 f"{(buffer.shape[0], *buffer.shape[2:])}")
            value = jax.device_put(value, _without_slot_axis(buffer.sharding))
            var.set_value(_set_slot(buffer, value, jnp.asarray(index, jnp.int32)))


def _without_slot_axis(target):
    """The sharding of one slot's [X, ...] from its buffer's [X, S, ...]."""
    if not isinstance(target, jax.sharding.NamedSharding):
        return target
    spec = tuple(target.spec)
    return jax.sharding.NamedSharding(target.mesh,
                                      jax.sharding.PartitionSpec(*spec[:1], *spec[2:]))
