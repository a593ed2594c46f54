"""The host side of draft-model speculation: how many of each sequence's tokens its draft
cache holds, the catch-up batch that brings it to the sequence's last token, and the
drafts the draft model proposes from there (serving/executor/draft_runner.py).

A sequence's draft cache holds the K/V of its first `computed` tokens: 0 at first and
after a preemption (its pages were freed, or swapped without the draft's K/V), then as
far as the catch-up reached and the sequence's pages go (a token whose page the target
has not allocated yet is computed again next time). The catch-up takes at most the
largest token bucket's tokens a step; a sequence whose catch-up does not end at its last
token this step (a long prompt) gets no drafts until it does.

An EAGLE-3 head (`lag` 1, serving/executor/eagle_runner.py) is fed at position i the
target's hidden states there and token i + 1: its catch-up ends at the sequence's
last token but one, and each row's input id is the token after its position.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from serving.core.request import Request
from serving.core.scheduler_output import ScheduledSeq, SchedulerOutput
from serving.executor.draft_runner import DraftRunner
from serving.executor.model_inputs import PageTable, build_model_inputs


class DraftModelProposer:
    def __init__(self, runner: DraftRunner, page_table: PageTable, *, page_size: int,
                 pages_per_seq: int, token_buckets: Sequence[int], seq_buckets: Sequence[int],
                 lag: int = 0):
        self.runner = runner
        self.lag = lag  # positions the catch-up stops short of the last token
        self.page_table = page_table
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.token_buckets = tuple(token_buckets)
        self.seq_buckets = tuple(seq_buckets)
        # request id -> (tokens its draft cache holds, its num_preemptions then)
        self._computed: dict[str, tuple[int, int]] = {}

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """Up to ks[i] drafts for requests[i] (each decoding: its last token is known);
        waits for them."""
        drafts, rows = self.dispatch(requests)
        if drafts is None:
            return [[] for _ in requests]
        k = self.runner.num_drafts
        host = np.asarray(drafts).tolist()
        return [[] if row is None else host[row * k:row * k + n] for row, n in zip(rows, ks)]

    def dispatch(self, requests: Sequence[Request]) -> tuple[jax.Array | None, list[int | None]]:
        """Start the proposal for `requests` (each decoding); returns at once with its flat
        drafts on the device (request i's k drafts at rows[i] * k, None for a request
        whose catch-up does not end this step; the array is None when none is proposed
        for)."""
        budget = max(self.token_buckets)
        scheduled: list[ScheduledSeq] = []
        rows: list[int | None] = []  # per request: its drafts' row, if its catch-up ends
        for request in requests:
            done, preemptions = self._computed.get(request.request_id,
                                                   (0, request.num_preemptions))
            if preemptions != request.num_preemptions:
                done = 0
            end = request.num_tokens - self.lag  # the catch-up's last row, + 1, gives
            start = min(done, end - 1)           # the first draft
            num = min(end - start, budget)
            if num <= 0:
                rows.append(None)
                continue
            budget -= num
            rows.append(len(scheduled) if start + num == end else None)
            scheduled.append(ScheduledSeq(request, num, start, True))
            allocated = len(request.page_ids) * self.page_size
            self._computed[request.request_id] = (min(start + num, allocated),
                                                  request.num_preemptions)
        if not scheduled:
            return None, rows
        inputs = build_model_inputs(SchedulerOutput(scheduled, []), self.token_buckets,
                                    self.seq_buckets, self.page_size, self.pages_per_seq,
                                    None, self.page_table)
        if self.lag:
            inputs.token_ids[:inputs.num_tokens] = np.fromiter(
                (t for seq in scheduled for t in seq.request.tokens(
                    seq.start + self.lag, seq.start + self.lag + seq.num_new_tokens)),
                np.int32, inputs.num_tokens)
        return self.runner.dispatch(inputs), rows

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)


__all__ = ["DraftModelProposer"]
