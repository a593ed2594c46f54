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

from collections.abc import Sequence

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


class PromptScoring:
    """The requests whose prompt is not all scored yet: a step costs nothing here unless
    some request still has positions to score (each step drops the finished ones)."""

    def __init__(self) -> None:
        self.pending: dict[str, ParentState] = {}  # request id -> it

    def watch(self, parent: ParentState) -> None:
        if parent.prompt_logprobs is not None and len(parent.prompt_token_ids) > 1:
            self.pending[parent.request_id] = parent

    def rows(self, out: SchedulerOutput, batch: ModelInputs, token_buckets: Sequence[int]
             ) -> tuple[np.ndarray | None, list[Claim]]:
        """The step's rows to score, int32[2, R] (row, the prompt token after it; padded
        to a token bucket), and what they belong to; (None, []) for a step without any."""
        if not self.pending:
            return None, []
        owners = {seq.request.request_id: parent for parent in self.pending.values()
                  for seq in parent.children}
        rows: list[int] = []
        targets: list[int] = []
        claims: list[Claim] = []
        for i, scheduled in enumerate(out.scheduled):
            parent = owners.get(scheduled.request.request_id)
            if parent is None:
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
        for request_id, parent in list(self.pending.items()):
            if parent.finished or parent.prompt_scored >= len(parent.prompt_token_ids) - 1:
                del self.pending[request_id]
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
        if entries is not None:  # (None once handed over)
            entries.extend(processor.logprob_entry(ids[first + 1 + j], scored, offset + j,
                                                   parent.num_prompt_logprobs)
                           for j in range(count))
        offset += count


__all__ = ["PromptScoring", "initial_entries", "record"]
