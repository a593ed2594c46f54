"""Mesh construction and the ONE table mapping logical axes to mesh axes.

Mesh axes: `stage` (pipeline parallel) x `expert` (expert parallel) x `model` (tensor
parallel). A stage holds its share of every segment's stacked layers (the `layers` axis) and
their KV pages (the cache is layer-major, so the `pages` axis splits the same way);
qwen_jax/model.py runs the stages in turn. Data parallelism is replicas: each replica is an
engine on its own sub-mesh of PP x TP x EP devices (vLLM's DP), so one mesh never has a data
axis of size > 1; it is kept so specs read the same.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Protocol

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pallas_kernels.quantized import QuantizedWeight
from qwen_jax.validation import require

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "stage", "expert", "model")

# The table: logical axis -> mesh axis (None = replicated).
LOGICAL_AXIS_RULES = {
    "layers": "stage",   # stacked layers of a scan segment
    "embed": None,       # D
    "vocab": ("stage", "model"),  # V: embedding rows and lm-head columns
    "heads": "model",    # N * H of q_proj / o_proj
    "kv_heads": "model", # K * H of k_proj / v_proj and the cache's K (see kv replication)
    "head_dim": None,    # H (q_norm / k_norm)
    "mlp": "model",      # dense FFN width
    "experts": "expert", # E
    "expert_mlp": "model",  # expert FFN width F
    "gate_up": None,     # the 2 of [E, D, 2, F]
    "router": None,      # E columns of the router (replicated: every device routes)
    "pages": "stage",    # cache pages (X * P, layer-major: a stage's layers' pages)
    "page_slots": None,  # L
    "lora_slots": None,  # S adapter slots of a LoRA buffer
    "lora_rank": None,   # R (times 2 or 3 for fused projections)
}

# Logical axes of every parameter, by the tail of its path (leading "layers" for stacks).
_PARAM_AXES = {
    ("embed_tokens",): ("vocab", "embed"),
    ("lm_head",): ("embed", "vocab"),
    ("norm", "weight"): ("embed",),
    ("input_layernorm", "weight"): ("embed",),
    ("post_attention_layernorm", "weight"): ("embed",),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("o_proj", "bias"): ("embed",),
    ("q_norm", "weight"): ("head_dim",),
    ("k_norm", "weight"): ("head_dim",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("mlp", "gate"): ("embed", "router"),
    ("mlp", "gate_up_proj"): ("experts", "embed", "gate_up", "expert_mlp"),
    ("mlp", "down_proj"): ("experts", "expert_mlp", "embed"),
}
KV_CACHE_AXES = ("pages", "page_slots", "kv_heads", "head_dim")

# LoRA buffers (qwen_jax/lora_layers.py): the experts' shard like their base weights; the
# others are replicated (dims past the listed axes are too).
_LORA_AXES = {
    "lora_experts_gate_up_a": ("experts", "embed", "lora_rank"),
    "lora_experts_gate_up_b": ("experts", "lora_rank", "gate_up", "expert_mlp"),
    "lora_experts_down_a": ("experts", "expert_mlp", "lora_rank"),
    "lora_experts_down_b": ("experts", "lora_rank", "embed"),
}


def lora_logical_axes(name: str) -> tuple:
    """Logical axes of the stacked LoRA buffer `name` ([X, S, ...])."""
    return ("layers", "lora_slots", *_LORA_AXES.get(name, ()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        for name in ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size",
                     "pipeline_parallel_size"):
            require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")

    @property
    def replica_size(self) -> int:
        return self.tensor_parallel_size * self.expert_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.replica_size * self.data_parallel_size

    def validate(self, cfg, num_devices: int) -> None:
        """Raise ValueError naming the field when the model cannot split this way."""
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if self.world_size > num_devices:
            raise ValueError(f"pipeline_parallel_size x tensor_parallel_size x "
                             f"expert_parallel_size x data_parallel_size = {self.world_size} "
                             f"exceeds the {num_devices} devices available")
        check_stages(cfg, self.pipeline_parallel_size)
        if cfg.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads="
                             f"{cfg.num_attention_heads}")
        k = cfg.num_key_value_heads
        if k % tp and tp % k:
            raise ValueError(f"tensor_parallel_size={tp} must divide or be a multiple of "
                             f"num_key_value_heads={k}")
        if cfg.is_moe:
            if cfg.num_experts % ep:
                raise ValueError(f"expert_parallel_size={ep} must divide num_experts="
                                 f"{cfg.num_experts}")
            if cfg.moe_intermediate_size % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide moe_intermediate_size="
                                 f"{cfg.moe_intermediate_size}")
        elif ep > 1:
            raise ValueError(f"expert_parallel_size={ep} needs an MoE model")
        if "dense" in cfg.layer_kinds and cfg.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size="
                             f"{cfg.intermediate_size}")


def check_stages(cfg, pipeline_parallel_size: int) -> None:
    """Each pipeline stage holds an equal share of every run of same-kind layers (a
    segment, one scan): ValueError naming the run PP does not divide."""
    pp = pipeline_parallel_size
    for kind, first, count in cfg.segments if pp > 1 else ():
        if count % pp:
            raise ValueError(
                f"pipeline_parallel_size={pp} must divide the {count} consecutive {kind} "
                f"layers from layer {first} (each stage holds an equal share of each run of "
                f"same-kind layers)")


def make_mesh(tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
              devices=None, pipeline_parallel_size: int = 1) -> Mesh:
    """A (data=1, stage, expert, model) mesh over the first PP x EP x TP of `devices`
    (stage s: the s-th run of EP x TP devices).

    Auto axes: the compiler propagates shardings between the explicit shard_map regions
    (jax.make_mesh defaults to Explicit axes, where ambiguous contractions are errors)."""
    pp, ep, tp = pipeline_parallel_size, expert_parallel_size, tensor_parallel_size
    size = pp * tp * ep
    devices = list(devices if devices is not None else jax.devices())[:size]
    if len(devices) < size:
        raise ValueError(f"need {size} devices for PP={pp} x TP={tp} x EP={ep}, have "
                         f"{len(devices)}")
    grid = np.array(devices).reshape(1, pp, ep, tp)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def pp_size(mesh: AxisSizes | None) -> int:
    return 1 if mesh is None else mesh.shape.get("stage", 1)


class AxisSizes(Protocol):
    """What the rules read of a mesh: its axis sizes (the planner has no devices)."""

    @property
    def shape(self) -> Mapping[str, int]: ...


def tp_size(mesh: AxisSizes | None) -> int:
    return 1 if mesh is None else mesh.shape["model"]


def kv_replication(num_kv_heads: int, mesh: AxisSizes | None) -> int:
    """How many copies of each KV head the cache holds: TP / K when TP > K (vLLM's scheme:
    every device keeps the one KV head its query heads read), else 1."""
    tp = tp_size(mesh)
    return tp // num_kv_heads if tp > num_kv_heads else 1


# A quantised weight's scales and zero points: <weight>_scale, <weight>_zero.
COMPANION_SUFFIXES = ("_scale", "_zero")


def base_name(name: str) -> str:
    """The weight a companion param belongs to ("kernel_scale" -> "kernel")."""
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def param_logical_axes(path: tuple) -> tuple:
    """Logical axes of the parameter at `path` (an nnx state path); a quantised weight's
    scales and zero points have their weight's axes (their dims count scale groups)."""
    names = tuple(p for p in path if isinstance(p, str))
    if names[-1].startswith("lora_"):
        return lora_logical_axes(names[-1])
    names = names[:-1] + (base_name(names[-1]),)
    stacked = names[0] == "segments"
    for n in (2, 1):
        if names[-n:] in _PARAM_AXES:
            axes = _PARAM_AXES[names[-n:]]
            return (("layers",) + axes) if stacked else axes
    raise ValueError(f"no logical axes are declared for parameter {'/'.join(map(str, path))}")


def spec_for(axes: tuple, shape: tuple, mesh: AxisSizes, num_kv_heads: int | None = None
             ) -> PartitionSpec:
    """PartitionSpec from logical axes via the table. A dim the mesh axis does not divide
    is replicated (vocab of a tiny model), and KV-head weights replicate when TP > K."""
    spec = []
    for axis, dim in zip(axes, shape):
        mesh_axis = mesh_rule(axis, mesh)
        replicated_kv = num_kv_heads is not None and kv_replication(num_kv_heads, mesh) > 1
        if axis == "kv_heads" and replicated_kv:
            mesh_axis = None
        if mesh_axis is not None and dim % axis_size(mesh, mesh_axis):
            logger.info("replicating a dim of %d over %s (not divisible by %d)", dim, mesh_axis,
                        axis_size(mesh, mesh_axis))
            mesh_axis = None
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def mesh_rule(axis: str, mesh: AxisSizes) -> str | tuple[str, ...] | None:
    """The table's mesh axis (or axes) for a logical axis, without `stage` when the mesh
    has one stage (specs then read as they do without pipeline parallelism)."""
    rule = LOGICAL_AXIS_RULES[axis]
    if rule is None or mesh.shape.get("stage", 1) > 1:
        return rule
    names = tuple(n for n in ((rule,) if isinstance(rule, str) else rule) if n != "stage")
    return None if not names else names[0] if len(names) == 1 else names


def axis_size(mesh: AxisSizes, mesh_axis: str | tuple[str, ...]) -> int:
    """Devices a dim is split over: one mesh axis, or several (their product)."""
    names = (mesh_axis,) if isinstance(mesh_axis, str) else mesh_axis
    return math.prod(mesh.shape.get(name, 1) for name in names)


def param_sharding(path, shape, mesh: Mesh, cfg) -> NamedSharding:
    axes = param_logical_axes(path)
    return NamedSharding(mesh, spec_for(axes, shape, mesh, cfg.num_key_value_heads))


def param_specs(shapes: dict, mesh, cfg) -> dict:
    """PartitionSpec of every param, {path: shape} in. A quantised weight's scales and zero
    points follow its split (`companion_spec`), which must fall on whole quantisation
    scale groups (`check_group_split`, ValueError naming the tensor otherwise)."""
    specs = {}
    for path, shape in shapes.items():
        base = path[:-1] + (base_name(path[-1]),)
        spec = spec_for(param_logical_axes(base), shapes[base], mesh, cfg.num_key_value_heads)
        if base != path:
            spec = companion_spec(spec, shapes[base], shape)
        elif path[:-1] + (path[-1] + "_scale",) in shapes:
            check_group_split(path, shape, spec, mesh, cfg)
        specs[path] = spec
    return specs


def param_shardings(shapes: dict, mesh: Mesh, cfg) -> dict:
    """NamedSharding of every param ({path: shape} in), as `param_specs`."""
    return {path: NamedSharding(mesh, spec)
            for path, spec in param_specs(shapes, mesh, cfg).items()}


def companion_spec(spec: PartitionSpec, weight_shape, shape) -> PartitionSpec:
    """The spec of a weight's scales or zero points: the weight's, except where they hold
    one entry for the whole of a split dim (per-channel scales over K): replicated."""
    return PartitionSpec(*(None if n == 1 and w > 1 else axis
                           for axis, w, n in zip(spec, weight_shape, shape)))


def weight_specs(weight, spec: PartitionSpec):
    """shard_map specs of a weight operand: `spec` for a float array, and for a
    QuantizedWeight the same spec for its values and companion specs for the rest."""
    if not isinstance(weight, QuantizedWeight):
        return spec
    values = weight.values.shape
    return dataclasses.replace(
        weight, values=spec, scales=companion_spec(spec, values, weight.scales.shape),
        zeros=None if weight.zeros is None else companion_spec(spec, values,
                                                               weight.zeros.shape))


def hf_name(path, cfg) -> str:
    """The HF tensors a param holds, for messages: segments/0/mlp/gate_up_proj ->
    model.layers.0-47.mlp.experts.*.gate_proj|up_proj."""
    names = [str(p) for p in path]
    if names[0] != "segments":
        return ".".join(names)
    _, first, count = cfg.segments[int(names[1])]
    sub = [n for n in names[2:] if n != "kernel"]
    if sub == ["mlp", "gate_up_proj"]:
        sub = ["mlp", "experts", "*", "gate_proj|up_proj"]
    elif sub == ["mlp", "down_proj"]:
        sub = ["mlp", "experts", "*", "down_proj"]
    return ".".join([f"model.layers.{first}-{first + count - 1}", *sub])


_SPLIT_OPTIONS = {"model": "tensor_parallel_size", "expert": "expert_parallel_size"}


def check_group_split(path, shape, spec, mesh, cfg) -> None:
    """A quantised weight split over devices must give each device whole scale groups
    along K and N (its scale rows and columns); ValueError naming the tensor, the split and
    the group otherwise (vLLM refuses the same splits)."""
    fmt = cfg.quantization.weight_format
    axes = param_logical_axes(path)
    k_dim = -3 if "gate_up" in axes else -2
    fields = ({"fp8": "weight_block_size[1]", "int4": "group_size"},
              {"fp8": "weight_block_size[0]"})
    for dim, group, field in ((k_dim, fmt.group_k, fields[0]), (-1, fmt.group_n, fields[1])):
        axis = spec[len(shape) + dim] if len(spec) >= len(shape) + dim + 1 else None
        if axis is None or group is None or group == 1:
            continue
        size = shape[dim] * (2 if fmt.kind == "int4" and dim == k_dim else 1)
        split = axis_size(mesh, axis)
        if (size // split) % group:
            hint = (" or shard the experts with expert_parallel_size instead"
                    if "experts" in axes else "")
            raise ValueError(
                f"cannot split quantised weight {hf_name(path, cfg)}: "
                f"{_SPLIT_OPTIONS.get(axis, axis)}={split} cuts its {axes[dim]} dim of {size} "
                f"into {size // split}-wide shards, not a multiple of the {fmt.kind} scale "
                f"block of {group} (quantization_config.{field[fmt.kind]}); use a split that "
                f"keeps whole blocks{hint}")


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The cache always has max(K, TP) heads, so the kv_heads dim divides evenly."""
    return NamedSharding(mesh, PartitionSpec(*(mesh_rule(a, mesh) for a in KV_CACHE_AXES)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def zeros(shape, dtype, target: NamedSharding | None = None) -> jax.Array:
    """Zeros created in their shards (also when the mesh spans several processes)."""
    import jax.numpy as jnp
    if target is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=target)()
