"""How much of its prompt a request computes in one step. Pure Python.

vLLM's `long_prefill_token_threshold` caps every request's chunk, and
`max_long_partial_prefills` limits how many requests with more than one capped chunk
left (long partial prefills) may be prefilling at once. Both default to off except under
length-aware (the short bound, one at a time): a step lasts as long as its padded token
count, and a short request waits for the step in flight when it arrives, then for its own.
A capped chunk is also trimmed when the tokens it puts past a token bucket are fewer than
the padding they bring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from serving.core.buckets import pick_bucket
from serving.core.config import SchedulerConfig
from serving.core.request import Request


class ScheduledChunk(Protocol):
    """What `trim` reads and shortens of a scheduled sequence (serving/core/scheduler.py's
    ScheduledSeq; not imported: the scheduler imports this module)."""

    request: Request
    start: int
    num_new_tokens: int


class PrefillCap:
    def __init__(self, config: SchedulerConfig):
        self.cap = config.prefill_chunk_cap  # None: only the step's budget limits a chunk
        self.limit = config.long_partial_prefill_limit  # None: any number at once
        self.token_buckets = config.token_bucket_sizes

    def chunk(self, num_left: int, budget: int) -> int:
        """Tokens of the `num_left` a request has to compute that it computes this step."""
        return min(num_left, budget, self.cap or num_left)

    def is_long(self, num_left: int) -> bool:
        """More tokens left than one capped chunk: a long partial prefill."""
        return self.cap is not None and num_left > self.cap

    def waits_for_slot(self, num_left: int, running: Sequence[Request]) -> bool:
        """A long partial prefill starts only while fewer than the limit of the running
        requests are in one (those always get their chunk)."""
        if self.limit is None or not self.is_long(num_left):
            return False
        num_long = sum(self.is_long(r.num_tokens_with_pending - r.num_computed_tokens)
                       for r in running)
        return num_long >= self.limit

    def trim(self, scheduled: Sequence[ScheduledChunk]) -> int:
        """Shorten the long partial prefills' chunks (latest first) so the step pads to
        the bucket below, when the tokens they put past it are fewer than the padding
        they bring: 16 decodes and a 128-token chunk run as 128 tokens, not 144 padded
        to 256. Returns the tokens cut (computed next step; their pages stay held)."""
        if self.cap is None:
            return 0
        total = sum(seq.num_new_tokens for seq in scheduled)
        lower = max((b for b in self.token_buckets if b < total), default=0)
        overflow = total - lower
        if lower == 0 or overflow >= pick_bucket(total, self.token_buckets) - total:
            return 0
        chunks = [seq for seq in scheduled
                  if self.is_long(seq.request.num_tokens_with_pending - seq.start)]
        if overflow > sum(seq.num_new_tokens - 1 for seq in chunks):
            return 0
        for seq in reversed(chunks):
            cut = min(overflow, seq.num_new_tokens - 1)
            seq.num_new_tokens -= cut
            overflow -= cut
        return total - lower
