"""Bucket sizes: each (token bucket T, sequence bucket S) pair is one compiled step.

Token buckets start at 8 and double up to 128: steps that small are bound by reading the
weights, so their padding rows cost little. Above 128 they grow by 1.5x and 2x in turn
(192, 256, 384, 512, 768, ...): a step pads by at most a third, and mixed prefill/decode
workloads pad about 15% of their rows where powers of two pad about 29% (measured over
the real scheduler's steps; git commit ba1f809). Sequence buckets start at 4: at batch
sizes below 4 the step is bound by reading the weights, so S=1 and S=2 would only add
compiles. From 256 tokens on a step compiles with one sequence bucket only, the largest
it can need: its cost is its tokens, and padding sequences add only rows of logits.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

MIN_TOKEN_BUCKET = 8
MIN_SEQ_BUCKET = 4
FINE_TOKEN_BUCKETS_FROM = 128
ONE_SEQ_BUCKET_FROM = 256


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


def make_token_buckets(limit: int, minimum: int = MIN_TOKEN_BUCKET) -> list[int]:
    """Powers of two up to FINE_TOKEN_BUCKETS_FROM, then 1.5x steps between them too."""
    powers = make_buckets(limit, minimum)
    fine = {p * 3 // 2 for p in powers if p >= FINE_TOKEN_BUCKETS_FROM}
    return sorted({b for b in set(powers) | fine if b < limit} | {limit})


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1] if buckets else None}")
    return buckets[i]


def _largest_seq_bucket(token_bucket: int, seq_buckets: Sequence[int]) -> int:
    """A step has at most one sequence per token: the largest S a T bucket can need."""
    return pick_bucket(min(token_bucket, seq_buckets[-1]), seq_buckets)


def pick_seq_bucket(token_bucket: int, num_seqs: int, seq_buckets: Sequence[int]) -> int:
    """The sequence bucket of a step padded to `token_bucket` tokens."""
    if token_bucket >= ONE_SEQ_BUCKET_FROM:
        return _largest_seq_bucket(token_bucket, seq_buckets)
    return pick_bucket(num_seqs, seq_buckets)


def bucket_pairs(token_buckets: Sequence[int], seq_buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Every (T, S) that build_model_inputs can pick."""
    pairs: list[tuple[int, int]] = []
    for t in token_buckets:
        max_s = _largest_seq_bucket(t, seq_buckets)
        if t >= ONE_SEQ_BUCKET_FROM:
            pairs.append((t, max_s))
        else:
            pairs.extend((t, s) for s in seq_buckets if s <= max_s)
    return pairs
