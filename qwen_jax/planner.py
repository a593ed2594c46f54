"""Memory planner: per-device weight bytes, KV pages that fit, max concurrent tokens, for a
config, dtype, PP x TP x EP layout and device memory; refuses layouts that cannot fit.
Under pipeline parallelism each stage's devices hold an equal share of the layers and of
their KV, and the embeddings and lm head split over stages and TP (qwen_jax/sharding.py)."""

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
    axis_size,
    check_stages,
    kv_replication,
    lora_logical_axes,
    param_specs,
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
    pipeline_parallel_size: int = 1  # stages, each of TP x EP devices

    @property
    def max_concurrent_tokens(self) -> int:
        return self.num_pages * self.page_size

    def summary(self) -> str:
        gb = 1e9
        lora = (f" + LoRA slots {self.lora_bytes_per_device / gb:.2f} GB/device"
                if self.lora_bytes_per_device else "")
        pp = self.pipeline_parallel_size
        stages = f"PP={pp} x " if pp > 1 else ""
        return (f"{stages}TP={self.tensor_parallel_size} x EP={self.expert_parallel_size}: "
                f"weights ({self.weights}) "
                f"{self.weight_bytes_per_device / gb:.1f} GB/device{lora} of "
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


def _mesh(tp: int, ep: int, pp: int = 1) -> _MeshShape:
    return _MeshShape({"data": 1, "stage": pp, "expert": ep, "model": tp})


def _split(spec, mesh: _MeshShape) -> int:
    return math.prod(axis_size(mesh, a) for a in spec if a is not None)


def weight_bytes_per_device(cfg: ModelConfig, dtype, tp: int, ep: int, pp: int = 1) -> int:
    """Bytes of the largest shard set one device holds, from abstract shapes alone: each
    param in its own dtype (quantised weights, their scales and zero points as stored;
    a split that breaks a quantisation block raises ValueError, as loading would)."""
    mesh = _mesh(tp, ep, pp)
    values = {path: var.get_value()
              for path, var in nnx.to_flat_state(_abstract_params(cfg, dtype))}
    specs = param_specs({path: v.shape for path, v in values.items()}, mesh, cfg)
    return sum(math.prod(value.shape) // _split(specs[path], mesh) * _itemsize(value.dtype)
               for path, value in values.items())


def lora_bytes_per_device(cfg: ModelConfig, dtype, tp: int, ep: int, max_loras: int,
                          max_lora_rank: int, pp: int = 1) -> int:
    """Bytes of the LoRA slot buffers (qwen_jax/lora_layers.py) one device holds: the
    experts' split like their weights, the rest replicated (a stage's layers' only)."""
    from qwen_jax.lora_layers import buffer_shapes
    mesh = _mesh(tp, ep, pp)
    total = 0
    for shapes in buffer_shapes(cfg, max_lora_rank):
        for name, shape in shapes.items():
            full = (shape[0], max_loras, *shape[1:])
            spec = spec_for(lora_logical_axes(name.split(".")[1]), full, mesh)
            total += math.prod(full) // _split(spec, mesh) * _itemsize(dtype)
    return total


def plan_memory(cfg: ModelConfig, *, dtype="bfloat16", tensor_parallel_size: int = 1,
                expert_parallel_size: int = 1, device_memory_bytes: int,
                gpu_memory_utilization: float = 0.9, block_size: int = 16,
                kv_cache_dtype=None, quantization: str | None = None, max_loras: int = 0,
                max_lora_rank: int = 16, pipeline_parallel_size: int = 1) -> MemoryPlan:
    """Raise ValueError (with the numbers) when the weights leave no room for the cache.
    quantization: fp8 | int8 | awq weights (default: the checkpoint config's, if any).
    max_loras: LoRA adapter slots (enable_lora), at max_lora_rank, counted beside them.
    pipeline_parallel_size: stages of TP x EP devices, each with 1 / PP of the layers."""
    dtype = resolve_dtype(dtype)
    cfg = dataclasses.replace(cfg, quantization=resolve_quantization(
        cfg.quantization, quantization, dummy=True))
    tp, ep, pp = tensor_parallel_size, expert_parallel_size, pipeline_parallel_size
    check_stages(cfg, pp)
    lora = (lora_bytes_per_device(cfg, dtype, tp, ep, max_loras, max_lora_rank, pp)
            if max_loras else 0)
    weights = weight_bytes_per_device(cfg, dtype, tp, ep, pp) + lora
    usable = int(device_memory_bytes * gpu_memory_utilization)
    per_page = kv_bytes_per_page(cfg, block_size, kv_cache_dtype or dtype, tp,
                                 cfg.num_hidden_layers // pp)
    num_pages = (usable - weights) // per_page
    if num_pages < 1:
        stages = f"pipeline_parallel_size={pp} x " if pp > 1 else ""
        raise ValueError(
            f"layout cannot fit: weights need {weights / 1e9:.1f} GB per device with "
            f"{stages}tensor_parallel_size={tp} x expert_parallel_size={ep} in "
            f"{_weights_name(cfg, dtype)}, "
            f"but only {usable / 1e9:.1f} GB are usable (gpu_memory_utilization="
            f"{gpu_memory_utilization} of {device_memory_bytes / 1e9:.1f} GB); add devices "
            f"or use a smaller dtype")
    return MemoryPlan(tp, ep, int(device_memory_bytes), usable, weights - lora, per_page,
                      int(num_pages), block_size, _weights_name(cfg, dtype), lora, pp)


def _weights_name(cfg: ModelConfig, dtype) -> str:
    """"bfloat16", or "fp8, rest bfloat16" for a quantised model."""
    if cfg.quantization is None:
        return np.dtype(dtype).name
    return f"{cfg.quantization.method}, rest {np.dtype(dtype).name}"
