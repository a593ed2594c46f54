"""Engine configs: frozen, keyword-only, validated on construction. Pure Python."""

from __future__ import annotations

import dataclasses
import functools

from qwen_jax.options import KV_CACHE_DTYPES
from serving.buckets import MIN_SEQ_BUCKET, MIN_TOKEN_BUCKET, make_buckets

POLICIES = ("fcfs", "priority")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _normalise_buckets(name: str, buckets, limit_name: str, limit: int) -> tuple[int, ...] | None:
    if buckets is None:
        return None
    sizes = tuple(sorted(set(int(b) for b in buckets)))
    _require(len(sizes) > 0 and sizes[0] >= 1, f"{name} must be positive ints, got {buckets!r}")
    _require(sizes[-1] >= limit,
             f"{name} must include a bucket >= {limit_name}={limit}, got max {sizes[-1]}")
    return sizes


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    swap_space: float = 0  # GiB of host memory for swapped-out pages; 0 = recompute

    def __post_init__(self) -> None:
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two >= 1, got {self.block_size}")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
                 "num_gpu_blocks_override must be >= 2 (page 0 is reserved) or None, "
                 f"got {self.num_gpu_blocks_override}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, "
                 f"got {self.kv_cache_dtype!r}")
        _require(self.swap_space >= 0, f"swap_space must be >= 0, got {self.swap_space}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's, capped (the engine resolves it)
    watermark: float = 0.01  # fraction of pages kept free when admitting
    policy: str = "fcfs"
    max_waiting: int | None = None  # None: unbounded waiting queue
    token_buckets: tuple[int, ...] | None = None  # None: powers of two
    seq_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens must be >= max_num_seqs={self.max_num_seqs}, "
                 f"got {self.max_num_batched_tokens}")
        _require(self.max_model_len is None or self.max_model_len >= 1,
                 f"max_model_len must be >= 1, got {self.max_model_len}")
        _require(0 <= self.watermark < 1, f"watermark must be in [0, 1), got {self.watermark}")
        _require(self.policy in POLICIES,
                 f"policy must be one of {POLICIES}, got {self.policy!r}")
        _require(self.max_waiting is None or self.max_waiting >= 1,
                 f"max_waiting must be >= 1 or None, got {self.max_waiting}")
        object.__setattr__(self, "token_buckets", _normalise_buckets(
            "token_buckets", self.token_buckets, "max_num_batched_tokens",
            self.max_num_batched_tokens))
        object.__setattr__(self, "seq_buckets", _normalise_buckets(
            "seq_buckets", self.seq_buckets, "max_num_seqs", self.max_num_seqs))

    @functools.cached_property
    def token_bucket_sizes(self) -> tuple[int, ...]:
        """Padded token counts T, one compiled step each."""
        if self.token_buckets is not None:
            return self.token_buckets
        return tuple(make_buckets(self.max_num_batched_tokens, minimum=MIN_TOKEN_BUCKET))

    @functools.cached_property
    def seq_bucket_sizes(self) -> tuple[int, ...]:
        """Padded sequence counts S."""
        if self.seq_buckets is not None:
            return self.seq_buckets
        return tuple(make_buckets(self.max_num_seqs, minimum=MIN_SEQ_BUCKET))

    def pages_per_seq(self, block_size: int) -> int:
        """Static page-table width: enough pages for max_model_len tokens."""
        _require(self.max_model_len is not None, "max_model_len is not resolved yet")
        return -(-self.max_model_len // block_size)

