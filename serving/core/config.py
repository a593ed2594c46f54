"""The cache and scheduler configs: frozen, keyword-only, validated on construction. Pure
Python."""

from __future__ import annotations

import dataclasses
import functools

from qwen_jax.options import KV_CACHE_DTYPES
from qwen_jax.validation import require
from serving.core.buckets import MIN_SEQ_BUCKET, make_buckets, make_token_buckets

LENGTH_AWARE = "length-aware"
POLICIES = ("fcfs", "priority", LENGTH_AWARE)  # the waiting queue's orders (policies.py)


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
    swap_space: float = 0  # GiB of host memory (per device) for swapped-out pages; 0: recompute
    swap_min_tokens: int = 256  # a preempted request with fewer computed tokens is recomputed

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
        require(self.swap_min_tokens >= 0, "swap_min_tokens", self.swap_min_tokens, ">= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's, capped (the engine resolves it)
    watermark: float = 0.05  # fraction of pages kept free when admitting (doubled if degraded)
    policy: str = "fcfs"  # or "priority", "length-aware" (serving/core/policies.py)
    length_buckets: tuple[int, ...] = (128, 512)  # prompt tokens: short < 128 <= medium < 512
    aging_interval: float = 1.0  # seconds of waiting worth one length bucket (length-aware)
    short_preempt_wait: float = 0.5  # s a short request waits before a long one is preempted
    # Most prefill tokens one request gets in a step (vLLM's name); 0: no cap; None: the
    # short bound (length_buckets[0]) under length-aware, no cap under the others.
    long_prefill_token_threshold: int | None = None
    # Most requests with more prefill tokens left than that cap computing a chunk in one
    # step (vLLM's name); None: 1 under length-aware, any number under the others.
    max_long_partial_prefills: int | None = None
    boost_wait: float = 0.2  # s of queue wait after which a request is boosted one level
    kv_plan_limit: float = 0.92  # admission plans at most this fraction of KV pages; 1: off
    # Auto-degradation (serving/core/degradation.py); an `inf` duration turns it off.
    degrade_kv_usage: float = 0.9
    degrade_after: float = 30.0
    restore_kv_usage: float = 0.8
    restore_after: float = 30.0
    degraded_token_fraction: float = 0.5  # of max_num_batched_tokens while degraded
    max_waiting: int | None = None  # None: unbounded waiting queue
    token_buckets: tuple[int, ...] | None = None  # None: powers of two
    seq_buckets: tuple[int, ...] | None = None
    # Overlap step N+1's scheduling and dispatch with step N's device time and output
    # processing (serving/engine/llm_engine.py); False: every step runs serially.
    async_scheduling: bool = True
    # A streamed request gets an output once it has this many new tokens (and for its
    # first token, and when it finishes): vLLM's and SGLang's option; 1 streams every token.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                self.max_num_batched_tokens, f">= max_num_seqs={self.max_num_seqs}")
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                self.max_model_len, ">= 1")
        require(0 <= self.watermark < 1, "watermark", self.watermark, "in [0, 1)")
        require(self.policy in POLICIES, "policy", self.policy, f"one of {POLICIES}")
        self._validate_policy_options()
        require(self.max_waiting is None or self.max_waiting >= 1, "max_waiting",
                self.max_waiting, ">= 1 or None")
        require(isinstance(self.stream_interval, int) and self.stream_interval >= 1,
                "stream_interval", self.stream_interval, "an int >= 1 (tokens)")
        object.__setattr__(self, "token_buckets", _normalise_buckets(
            "token_buckets", self.token_buckets, "max_num_batched_tokens",
            self.max_num_batched_tokens))
        object.__setattr__(self, "seq_buckets", _normalise_buckets(
            "seq_buckets", self.seq_buckets, "max_num_seqs", self.max_num_seqs))

    def _validate_policy_options(self) -> None:
        bounds = tuple(int(b) for b in self.length_buckets)
        require(len(bounds) == 2 and 1 <= bounds[0] < bounds[1], "length_buckets",
                self.length_buckets, "two increasing prompt lengths >= 1 (short < a <= "
                "medium < b <= long)")
        object.__setattr__(self, "length_buckets", bounds)
        require(0 < self.aging_interval < float("inf"), "aging_interval", self.aging_interval,
                "a finite number of seconds > 0")
        for name in ("short_preempt_wait", "boost_wait", "degrade_after", "restore_after"):
            require(getattr(self, name) >= 0, name, getattr(self, name),
                    ">= 0 seconds (inf: never)")
        require(self.long_prefill_token_threshold is None
                or self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                self.long_prefill_token_threshold, ">= 0 tokens (0: no cap) or None")
        require(self.max_long_partial_prefills is None or self.max_long_partial_prefills >= 1,
                "max_long_partial_prefills", self.max_long_partial_prefills, ">= 1 or None")
        require(0 < self.kv_plan_limit <= 1, "kv_plan_limit", self.kv_plan_limit, "in (0, 1]")
        require(0 < self.degrade_kv_usage <= 1, "degrade_kv_usage", self.degrade_kv_usage,
                "in (0, 1]")
        require(0 <= self.restore_kv_usage <= self.degrade_kv_usage, "restore_kv_usage",
                self.restore_kv_usage, f"in [0, degrade_kv_usage={self.degrade_kv_usage}]")
        require(0 < self.degraded_token_fraction <= 1, "degraded_token_fraction",
                self.degraded_token_fraction, "in (0, 1]")

    @functools.cached_property
    def token_bucket_sizes(self) -> tuple[int, ...]:
        """Padded token counts T (serving/core/buckets.py has the reasoning)."""
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
    def prefill_chunk_cap(self) -> int | None:
        """Most prefill tokens one request gets in a step; None: only the budget limits it."""
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            threshold = self.length_buckets[0] if self.policy == LENGTH_AWARE else 0
        return threshold or None

    @property
    def long_partial_prefill_limit(self) -> int | None:
        """Most requests with more than prefill_chunk_cap tokens left prefilled in a step;
        None: no limit."""
        if self.prefill_chunk_cap is None:
            return None
        if self.max_long_partial_prefills is None and self.policy == LENGTH_AWARE:
            return 1
        return self.max_long_partial_prefills

    @property
    def resolved_max_model_len(self) -> int:
        """max_model_len once the engine has resolved None to the model's."""
        if self.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet (the engine sets it)")
        return self.max_model_len

    def pages_per_seq(self, page_size: int) -> int:
        """Static page-table width: enough pages for max_model_len tokens."""
        return -(-self.resolved_max_model_len // page_size)
