"""Engine and server configs: frozen, keyword-only, validated on construction. Pure Python."""

from __future__ import annotations

import dataclasses
import functools

from qwen_jax.options import KV_CACHE_DTYPES
from qwen_jax.validation import require
from serving.buckets import MIN_SEQ_BUCKET, make_buckets, make_token_buckets
from serving.reasoning import reasoning_parser_class

POLICIES = ("fcfs", "priority")


def _normalise_buckets(name: str, buckets, limit_name: str, limit: int) -> tuple[int, ...] | None:
    if buckets is None:
        return None
    sizes = tuple(sorted(set(int(b) for b in buckets)))
    require(len(sizes) > 0 and sizes[0] >= 1, name, buckets, "positive ints")
    if sizes[-1] < limit:  # names the largest bucket rather than them all
        raise ValueError(f"{name} must include a bucket >= {limit_name}={limit}, "
                         f"got max {sizes[-1]}")
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
        require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                "block_size", self.block_size, "a power of two >= 1")
        require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
                "num_gpu_blocks_override", self.num_gpu_blocks_override,
                ">= 2 (page 0 is reserved) or None")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                self.gpu_memory_utilization, "in (0, 1]")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
                f"one of {', '.join(KV_CACHE_DTYPES)}")
        require(self.swap_space >= 0, "swap_space", self.swap_space, ">= 0")


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
        require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                self.max_num_batched_tokens, f">= max_num_seqs={self.max_num_seqs}")
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                self.max_model_len, ">= 1")
        require(0 <= self.watermark < 1, "watermark", self.watermark, "in [0, 1)")
        require(self.policy in POLICIES, "policy", self.policy, f"one of {POLICIES}")
        require(self.max_waiting is None or self.max_waiting >= 1, "max_waiting",
                self.max_waiting, ">= 1 or None")
        object.__setattr__(self, "token_buckets", _normalise_buckets(
            "token_buckets", self.token_buckets, "max_num_batched_tokens",
            self.max_num_batched_tokens))
        object.__setattr__(self, "seq_buckets", _normalise_buckets(
            "seq_buckets", self.seq_buckets, "max_num_seqs", self.max_num_seqs))

    @functools.cached_property
    def token_bucket_sizes(self) -> tuple[int, ...]:
        """Padded token counts T (serving/buckets.py has the reasoning)."""
        if self.token_buckets is not None:
            return self.token_buckets
        return tuple(make_token_buckets(self.max_num_batched_tokens))

    @functools.cached_property
    def seq_bucket_sizes(self) -> tuple[int, ...]:
        """Padded sequence counts S."""
        if self.seq_buckets is not None:
            return self.seq_buckets
        return tuple(make_buckets(self.max_num_seqs, minimum=MIN_SEQ_BUCKET))

    @property
    def resolved_max_model_len(self) -> int:
        """max_model_len once the engine has resolved None to the model's."""
        if self.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet (the engine sets it)")
        return self.max_model_len

    def pages_per_seq(self, page_size: int) -> int:
        """Static page-table width: enough pages for max_model_len tokens."""
        return -(-self.resolved_max_model_len // page_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """`qwen-jax serve`'s HTTP options (the engine's are EngineConfig's)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_request_body_mb: float = 8.0
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    log_interval: float = 10.0  # seconds between throughput lines; 0 disables
    retry_after: int = 1  # seconds, sent with 503 when the waiting queue is full
    reasoning_parser: str | None = None  # e.g. "qwen3": chat replies split out reasoning_content

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", self.port, "in [0, 65535]")
        require(self.max_request_body_mb > 0, "max_request_body_mb", self.max_request_body_mb,
                "> 0")
        require(self.shutdown_timeout >= 0, "shutdown_timeout", self.shutdown_timeout, ">= 0")
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)
