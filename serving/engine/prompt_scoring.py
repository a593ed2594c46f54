"""Prompt logprobs (vLLM's `prompt_logprobs`) in the continuous batch: a request that asks
for them has the logprob of each prompt token given the ones before it (and the most
likely tokens there) read off its own prefill rows, chunk by chunk, in the steps that
compute them (serving/executor/model_runner.py scores the rows the step names), in
every loop, layout and sharding the steps run in.

Row p of a chunk scores prompt token p + 1, so a request's entries are [None] (its first
token), then one per position up to its last prompt token. Its prefill never starts from
the prefix cache (serving/core/kv_cache_manager.py): cached tokens have no rows. Positions
are claimed once, from the first uncovered one: a chunk computed again after a
preemption, or by the request's other samples (n > 1), is not scored twice, and whichever
sample's prefill gets there first scores a position (so the entries are complete when any
sample's first token is out, the output that hands them over).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from serving.core.buckets import pick_bucket
from serving.core.scheduler_output import SchedulerOutput
from serving.engine.output_processor import OutputProcessor, ParentState
from serving.executor import distributed
from serving.executor.model_inputs import ModelInputs
from serving.sample.sampling_arrays import TokenLogprobs

Claim = tuple[ParentState, int, int]  # (request, first position scored, positions)


def initial_entries(num_logprobs: int | None) -> list | None:
    """A new request's prompt logprobs so far: [None] (its first token has none)."""
    if num_logprobs is None:
        return None
    if distributed.is_multiprocess():
        raise ValueError("prompt_logprobs is not supported with multiple processes")
    return [None]


def score_rows(out: SchedulerOutput, batch: ModelInputs,
               parent_of: Callable[[str], ParentState | None],
               token_buckets: Sequence[int]) -> tuple[np.ndarray | None, list[Claim]]:
    """The step's rows to score, int32[2, R] (row, the prompt token after it; padded to a
    token bucket), and what they belong to; (None, []) for a step without any."""
    rows: list[int] = []
    targets: list[int] = []
    claims: list[Claim] = []
    for i, scheduled in enumerate(out.scheduled):
        parent = parent_of(scheduled.request.request_id)
        if parent is None or parent.prompt_logprobs is None:
            continue
        ids = parent.prompt_token_ids
        start, done = scheduled.start, parent.prompt_scored
        end = min(start + scheduled.num_new_tokens, len(ids) - 1)
        if start > done or end <= done:  # a gap before it, or nothing new
            continue
        first_row = int(batch.query_start[i]) + done - start
        rows.extend(range(first_row, first_row + end - done))
        targets.extend(ids[done + 1:end + 1])
        claims.append((parent, done, end - done))
        parent.prompt_scored = end
    if not rows:
        return None, []
    padded = np.zeros((2, pick_bucket(len(rows), token_buckets)), np.int32)
    padded[0, :len(rows)], padded[1, :len(rows)] = rows, targets
    return padded, claims


def record(claims: list[Claim], scored: TokenLogprobs | None,
           processor: OutputProcessor) -> None:
    """Append each claimed position's entry to its request's prompt logprobs."""
    if scored is None:
        return
    offset = 0
    for parent, first, count in claims:
        entries, ids = parent.prompt_logprobs, parent.prompt_token_ids
        for j in range(count):
            if entries is not None:  # (None once handed over)
                entries.append(processor.logprob_entry(ids[first + 1 + j], scored, offset + j,
                                                       parent.num_prompt_logprobs))
        offset += count


__all__ = ["initial_entries", "record", "score_rows"]
