"""Bucket sizes: each (token bucket T, sequence bucket S) pair is one compiled step.

Token buckets start at 8. Sequence buckets start at 4: at batch sizes below 4 the
step is bound by reading the weights, so S=1 and S=2 would only add compiles.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

MIN_TOKEN_BUCKET = 8
MIN_SEQ_BUCKET = 4


def make_buckets(limit: int, minimum: int = 1) -> list[int]:
    """Powers of two from `minimum` (rounded up to one) below `limit`, then `limit`."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    if minimum < 1:
        raise ValueError(f"bucket minimum must be >= 1, got {minimum}")
    size = 1 << (minimum - 1).bit_length()
    buckets = []
    while size < limit:
        buckets.append(size)
        size *= 2
    buckets.append(limit)
    return buckets


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1] if buckets else None}")
    return buckets[i]


def bucket_pairs(token_buckets: Sequence[int], seq_buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Every (T, S) that build_model_inputs can pick: a step has at most one
    sequence per token, so S never exceeds the bucket that holds T sequences."""
    pairs: list[tuple[int, int]] = []
    for t in token_buckets:
        max_s = pick_bucket(min(t, seq_buckets[-1]), seq_buckets)
        pairs.extend((t, s) for s in seq_buckets if s <= max_s)
    return pairs
