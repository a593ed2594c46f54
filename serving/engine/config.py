"""EngineConfig: the model, cache, scheduler and parallel configs of one engine, and how
vLLM-style flat keyword arguments become one."""

from __future__ import annotations

import dataclasses
from typing import Any

import pallas_kernels
from qwen_jax.options import LOAD_FORMATS, PARAM_DTYPES, QUANTIZATION_METHODS
from qwen_jax.sharding import ParallelConfig
from qwen_jax.validation import require
from serving.core.buckets import MIN_SEQ_BUCKET, make_buckets
from serving.core.config import CacheConfig, SchedulerConfig
from serving.core.speculative import SpeculativeConfig

DTYPES = ("auto", *PARAM_DTYPES)  # auto: float32 on CPU, bfloat16 on GPU
IMPLS = ("auto", *pallas_kernels.IMPLS)  # auto: pallas on GPU, reference elsewhere


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything `LLMEngine` needs; `LLM(...)` keyword arguments map onto these fields."""

    model: str | None = None  # checkpoint dir or preset name; None: the embedded default
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype (bf16) on GPU
    impl: str = "auto"  # kernels: auto = pallas on GPU, reference elsewhere
    # The device probe's kernel_table.json: the implementation per op and shape (the
    # Triton or Mosaic GPU kernel, XLA's ragged_dot); None: `impl` at every shape.
    kernel_table: str | None = None
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
    # vLLM's speculative_config (a dict, its JSON text or a SpeculativeConfig; None: off).
    # Methods ngram, draft_model and eagle3 (serving/engine/speculation.py).
    speculative_config: SpeculativeConfig | None = None
    # Multi-LoRA (vLLM's options): adapters in device slots at once, their largest rank,
    # and how many stay packed in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        sched = self.scheduler
        if spec is not None and sched.seq_buckets is None:
            # a step's rows: a sequence's and one per draft, so max_num_seqs sequences
            # verify k drafts each (the rows never exceed the step's tokens)
            rows = min(sched.max_num_seqs * (1 + spec.num_speculative_tokens),
                       sched.max_num_batched_tokens)
            object.__setattr__(self, "scheduler", dataclasses.replace(
                sched, seq_buckets=tuple(make_buckets(rows, minimum=MIN_SEQ_BUCKET))))
        require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        require(self.impl in IMPLS, "impl", self.impl, f"one of {IMPLS}")
        require(self.load_format in LOAD_FORMATS, "load_format", self.load_format,
                f"one of {LOAD_FORMATS}")
        require(self.max_loras >= 1, "max_loras", self.max_loras, ">= 1")
        require(self.max_lora_rank >= 1, "max_lora_rank", self.max_lora_rank, ">= 1")
        require(self.quantization in (None, *QUANTIZATION_METHODS), "quantization",
                self.quantization, f"one of {QUANTIZATION_METHODS}, or None (the checkpoint's)")


_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHED_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_PARALLEL_FIELDS = {f.name for f in dataclasses.fields(ParallelConfig)}
_ENGINE_FIELDS = ({f.name for f in dataclasses.fields(EngineConfig)}
                  - {"cache", "scheduler", "parallel"})


# names whose None is a choice (no override, no bound, no persistent cache); others' None
# means not given (the CLI's unset options), so the default applies
_NONE_IS_A_VALUE = ("num_gpu_blocks_override", "max_waiting", "compilation_cache_dir")


def engine_config_from_kwargs(model=None, **kwargs) -> EngineConfig:
    """vLLM-style flat keyword arguments -> EngineConfig (unknown names are an error)."""
    groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "parallel": {},
                                         "engine": {}}
    for name, value in kwargs.items():
        if value is None and name not in _NONE_IS_A_VALUE:
            continue
        if name in _CACHE_FIELDS:
            groups["cache"][name] = value
        elif name in _SCHED_FIELDS:
            groups["scheduler"][name] = value
        elif name in _PARALLEL_FIELDS:
            groups["parallel"][name] = value
        elif name in _ENGINE_FIELDS:
            groups["engine"][name] = value
        else:
            raise TypeError(f"unknown engine argument {name!r}")
    return EngineConfig(model=model, cache=CacheConfig(**groups["cache"]),
                        scheduler=SchedulerConfig(**groups["scheduler"]),
                        parallel=ParallelConfig(**groups["parallel"]), **groups["engine"])


def one_replica_config(model: str | None, **kwargs) -> EngineConfig:
    """The EngineConfig of an async engine's keyword arguments: one replica (data
    parallelism behind one server is serving/engine/data_parallel.py's DPAsyncLLM)."""
    config = engine_config_from_kwargs(model, **kwargs)
    if config.parallel.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={config.parallel.data_parallel_size}: one engine runs one "
            "replica; DPAsyncLLM (qwen-jax serve --data-parallel-size) runs an engine "
            "process per replica")
    return config
