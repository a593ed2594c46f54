"""Memory planner: per-device weight bytes, KV pages that fit, max concurrent tokens, for a
config, dtype, PP x TP x EP layout and device memory; refuses layouts that cannot fit.
Under pipeline parallelism each stage's devices hold its layers' weights and KV (the first
stage the embeddings, the last the final norm and lm head, and the embeddings again when the
lm head is tied to them); the plan reports the fullest stage and the pages every stage fits."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx

from qwen_jax.config import ModelConfig
from qwen_jax.model import Qwen3ForCausalLM
from qwen_jax.params import abstract_model, resolve_dtype
from qwen_jax.quantization import resolve as resolve_quantization
from qwen_jax.sharding import (
    kv_replication,
    lora_logical_axes,
    param_specs,
    pipeline_stages,
    spec_for,
)


@dataclasses.dataclass(frozen=True)
class _MeshShape:
    """Just the axis sizes: planning needs no devices."""

    shape: dict[str, int]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    tensor_parallel_size: int
    expert_parallel_size: int
    device_memory_bytes: int
    usable_bytes: int  # device memory x gpu_memory_utilization
    weight_bytes_per_device: int
    kv_bytes_per_page_per_device: int
    num_pages: int
    page_size: int  # tokens per KV page (vLLM's option `block_size`)
    weights: str = ""  # the weights' dtype, or their quantisation and the rest's dtype
    lora_bytes_per_device: int = 0  # the LoRA slots (max_loras adapters at max_lora_rank)
    pipeline_parallel_size: int = 1  # stages; the bytes above are the fullest stage's

    @property
    def max_concurrent_tokens(self) -> int:
        return self.num_pages * self.page_size

    def summary(self) -> str:
        gb = 1e9
        lora = (f" + LoRA slots {self.lora_bytes_per_device / gb:.2f} GB/device"
                if self.lora_bytes_per_device else "")
        pp = self.pipeline_parallel_size
        stages = f"PP={pp} x " if pp > 1 else ""
        fullest = " (the fullest stage)" if pp > 1 else ""
        return (f"{stages}TP={self.tensor_parallel_size} x EP={self.expert_parallel_size}: "
                f"weights ({self.weights}) "
                f"{self.weight_bytes_per_device / gb:.1f} GB/device{fullest}{lora} of "
                f"{self.usable_bytes / gb:.1f} GB usable; KV "
                f"{self.kv_bytes_per_page_per_device / 2**10:.0f} KiB/page/device -> "
                f"{self.num_pages:,} pages = {self.max_concurrent_tokens:,} tokens")


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype,
                      tensor_parallel_size: int = 1, num_layers: int | None = None) -> int:
    """K and V of every layer (or of `num_layers`: a pipeline stage's) for one page of
    `page_size` tokens, on one device: its share of the cache's heads (K / TP, or one copy
    of a head when TP > K)."""
    tp = tensor_parallel_size
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    heads = cfg.num_key_value_heads * kv_replication(cfg.num_key_value_heads,
                                                    _MeshShape({"model": tp})) // tp
    return 2 * layers * page_size * max(heads, 1) * cfg.head_dim * _itemsize(dtype)


def _abstract_params(cfg: ModelConfig, dtype="float32") -> nnx.State:
    return nnx.state(abstract_model(cfg, dtype, model_cls=Qwen3ForCausalLM), nnx.Param)


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the model (quantised or not: the float model's count)."""
    params = _abstract_params(dataclasses.replace(cfg, quantization=None))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def weight_bytes_per_device(cfg: ModelConfig, dtype, tp: int, ep: int) -> int:
    """Bytes of the largest shard set one device holds, from abstract shapes alone: each
    param in its own dtype (quantised weights, their scales and zero points as stored;
    a split that breaks a quantisation block raises ValueError, as loading would)."""
    return stage_weight_bytes(cfg, dtype, tp, ep, 1)[0]


def stage_weight_bytes(cfg: ModelConfig, dtype, tp: int, ep: int, pp: int) -> list[int]:
    """`weight_bytes_per_device` for a device of each pipeline stage."""
    mesh = _MeshShape({"data": 1, "expert": ep, "model": tp})
    values = {path: var.get_value()
              for path, var in nnx.to_flat_state(_abstract_params(cfg, dtype))}
    specs = param_specs({path: v.shape for path, v in values.items()}, mesh, cfg)
    stages = pipeline_stages(cfg.num_hidden_layers, pp)
    totals = [0] * pp
    for path, value in values.items():
        factor = math.prod(mesh.shape[a] for a in specs[path] if a is not None)
        size = math.prod(value.shape) // factor * _itemsize(value.dtype)
        if path[0] == "segments":  # [X, ...]: X consecutive layers, split by stage
            index = path[1]
            assert isinstance(index, int), path
            _, first, count = cfg.segments[index]
            for s, layers in enumerate(stages):
                held = len(range(max(first, layers.start), min(first + count, layers.stop)))
                totals[s] += size * held // count
            continue
        holders = {0} if path[0] == "embed_tokens" else {pp - 1}
        if path[0] == "embed_tokens" and cfg.tie_word_embeddings:
            holders.add(pp - 1)  # the tied lm head reads them on the last stage
        for s in holders:
            totals[s] += size
    return totals


def lora_bytes_per_device(cfg: ModelConfig, dtype, tp: int, ep: int, max_loras: int,
                          max_lora_rank: int, layers: range | None = None) -> int:
    """Bytes of the LoRA slot buffers (qwen_jax/lora_layers.py) one device holds: the
    experts' split like their weights, the rest replicated; of `layers` only (a pipeline
    stage's) when given."""
    from qwen_jax.lora_layers import buffer_shapes
    mesh = _MeshShape({"data": 1, "expert": ep, "model": tp})
    layers = layers if layers is not None else range(cfg.num_hidden_layers)
    total = 0
    for (_, first, count), shapes in zip(cfg.segments, buffer_shapes(cfg, max_lora_rank)):
        held = len(range(max(first, layers.start), min(first + count, layers.stop)))
        for name, shape in shapes.items():
            full = (shape[0], max_loras, *shape[1:])
            spec = spec_for(lora_logical_axes(name.split(".")[1]), full, mesh)
            factor = math.prod(mesh.shape[a] for a in spec if a is not None)
            total += math.prod(full) // factor * _itemsize(dtype) * held // count
    return total


def plan_memory(cfg: ModelConfig, *, dtype="bfloat16", tensor_parallel_size: int = 1,
                expert_parallel_size: int = 1, device_memory_bytes: int,
                gpu_memory_utilization: float = 0.9, block_size: int = 16,
                kv_cache_dtype=None, quantization: str | None = None, max_loras: int = 0,
                max_lora_rank: int = 16, pipeline_parallel_size: int = 1) -> MemoryPlan:
    """Raise ValueError (with the numbers) when the weights leave no room for the cache.
    quantization: fp8 | int8 | awq weights (default: the checkpoint config's, if any).
    max_loras: LoRA adapter slots (enable_lora), at max_lora_rank, counted beside them.
    pipeline_parallel_size: stages of TP x EP devices; the fullest stage's bytes, and the
    pages every stage fits."""
    dtype = resolve_dtype(dtype)
    cfg = dataclasses.replace(cfg, quantization=resolve_quantization(
        cfg.quantization, quantization, dummy=True))
    tp, ep, pp = tensor_parallel_size, expert_parallel_size, pipeline_parallel_size
    stages = pipeline_stages(cfg.num_hidden_layers, pp)
    weights = stage_weight_bytes(cfg, dtype, tp, ep, pp)
    lora = [lora_bytes_per_device(cfg, dtype, tp, ep, max_loras, max_lora_rank, layers)
            if max_loras else 0 for layers in stages]
    usable = int(device_memory_bytes * gpu_memory_utilization)
    per_page = [kv_bytes_per_page(cfg, block_size, kv_cache_dtype or dtype, tp, len(layers))
                for layers in stages]
    pages = [(usable - w - a) // p for w, a, p in zip(weights, lora, per_page)]
    s = max(range(pp), key=lambda i: weights[i] + lora[i])  # the fullest stage
    if min(pages) < 1:
        s = min(range(pp), key=lambda i: pages[i])
        stage = f" on pipeline stage {s} (layers {stages[s].start}-{stages[s].stop - 1})"
        raise ValueError(
            f"layout cannot fit: weights need {(weights[s] + lora[s]) / 1e9:.1f} GB per "
            f"device{stage if pp > 1 else ''} with "
            f"tensor_parallel_size={tp} x expert_parallel_size={ep} in "
            f"{_weights_name(cfg, dtype)}, "
            f"but only {usable / 1e9:.1f} GB are usable (gpu_memory_utilization="
            f"{gpu_memory_utilization} of {device_memory_bytes / 1e9:.1f} GB); add devices "
            f"or use a smaller dtype")
    return MemoryPlan(tp, ep, int(device_memory_bytes), usable, weights[s], max(per_page),
                      int(min(pages)), block_size, _weights_name(cfg, dtype), lora[s], pp)


def _weights_name(cfg: ModelConfig, dtype) -> str:
    """"bfloat16", or "fp8, rest bfloat16" for a quantised model."""
    if cfg.quantization is None:
        return np.dtype(dtype).name
    return f"{cfg.quantization.method}, rest {np.dtype(dtype).name}"
