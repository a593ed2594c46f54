"""EngineConfig: the model, cache, scheduler and parallel configs of one engine."""

from __future__ import annotations

import dataclasses

from qwen_jax.quantization import QUANTIZATION_METHODS
from qwen_jax.sharding import ParallelConfig
from serving.config import CacheConfig, SchedulerConfig, _require

DTYPES = ("auto", "float32", "bfloat16", "float16")
IMPLS = ("auto", "pallas", "reference")
LOAD_FORMATS = ("auto", "dummy", "safetensors", "orbax")


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

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.impl in IMPLS, f"impl must be one of {IMPLS}, got {self.impl!r}")
        _require(self.load_format in LOAD_FORMATS,
                 f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _require(self.quantization in (None, *QUANTIZATION_METHODS),
                 f"quantization must be one of {QUANTIZATION_METHODS} (or None: the "
                 f"checkpoint's), got {self.quantization!r}")
