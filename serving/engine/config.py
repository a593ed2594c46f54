"""EngineConfig: the model, cache, scheduler and parallel configs of one engine."""

from __future__ import annotations

import dataclasses

import pallas_kernels
from qwen_jax.options import LOAD_FORMATS, PARAM_DTYPES, QUANTIZATION_METHODS
from qwen_jax.sharding import ParallelConfig
from qwen_jax.validation import require
from serving.core.config import CacheConfig, SchedulerConfig

DTYPES = ("auto", *PARAM_DTYPES)  # auto: float32 on CPU, bfloat16 on GPU
IMPLS = ("auto", *pallas_kernels.IMPLS)  # auto: pallas on GPU, reference elsewhere


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything `LLMEngine` needs; `LLM(...)` keyword arguments map onto these fields."""

    model: str | None = None  # checkpoint dir or preset name; None: the embedded default
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype (bf16) on GPU
    impl: str = "auto"  # kernels: auto = pallas on GPU, reference elsewhere
    load_format: str = "auto"
    # None: the checkpoint's own (fp8 / AWQ checkpoints load quantised); fp8 | int8:
    # quantise a float checkpoint at load; must match a quantised checkpoint's method.
    quantization: str | None = None
    seed: int = 0
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compilation_cache_dir: str | None = "default"  # None or "": off
    precompile: bool = True
    show_progress: bool = True
    # sampling defaults: "auto" reads the model's generation_config.json, "vllm" uses
    # neutral ones, a directory names another generation_config.json (vLLM's option)
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        require(self.impl in IMPLS, "impl", self.impl, f"one of {IMPLS}")
        require(self.load_format in LOAD_FORMATS, "load_format", self.load_format,
                f"one of {LOAD_FORMATS}")
        require(self.quantization in (None, *QUANTIZATION_METHODS), "quantization",
                self.quantization, f"one of {QUANTIZATION_METHODS}, or None (the checkpoint's)")
