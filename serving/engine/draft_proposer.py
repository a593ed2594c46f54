"""The host side of draft-model speculation: how many of each sequence's tokens its draft
cache holds, the catch-up batch that brings it to the sequence's last token, and the
drafts the draft model proposes from there (serving/executor/draft_runner.py).

A sequence's draft cache holds the K/V of its first `computed` tokens: 0 at first and
after a preemption (its pages were freed, or swapped without the draft's K/V), then as
far as the catch-up reached and the sequence's pages go (a token whose page the target
has not allocated yet is computed again next time). The catch-up takes at most the
largest token bucket's tokens a step; a sequence whose catch-up does not end at its last
token this step (a long prompt) gets no drafts until it does.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.core.request import Request
from serving.core.scheduler_output import ScheduledSeq, SchedulerOutput
from serving.executor.draft_runner import DraftRunner
from serving.executor.model_inputs import PageTable, build_model_inputs


class DraftModelProposer:
    def __init__(self, runner: DraftRunner, page_table: PageTable, *, page_size: int,
                 pages_per_seq: int, token_buckets: Sequence[int], seq_buckets: Sequence[int]):
        self.runner = runner
        self.page_table = page_table
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.token_buckets = tuple(token_buckets)
        self.seq_buckets = tuple(seq_buckets)
        # request id -> (tokens its draft cache holds, its num_preemptions then)
        self._computed: dict[str, tuple[int, int]] = {}

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """Up to ks[i] drafts for requests[i] (each decoding: its last token is known)."""
        budget = max(self.token_buckets)
        scheduled: list[ScheduledSeq] = []
        rows: list[int | None] = []  # per request: its drafts' row, if its catch-up ends
        for request in requests:
            done, preemptions = self._computed.get(request.request_id,
                                                   (0, request.num_preemptions))
            if preemptions != request.num_preemptions:
                done = 0
            num_tokens = request.num_tokens
            start = min(done, num_tokens - 1)  # the last token's row gives the first draft
            num = min(num_tokens - start, budget)
            if num <= 0:
                rows.append(None)
                continue
            budget -= num
            rows.append(len(scheduled) if start + num == num_tokens else None)
            scheduled.append(ScheduledSeq(request, num, start, True))
            allocated = len(request.page_ids) * self.page_size
            self._computed[request.request_id] = (min(start + num, allocated),
                                                  request.num_preemptions)
        if not scheduled:
            return [[] for _ in requests]
        inputs = build_model_inputs(SchedulerOutput(scheduled, []), self.token_buckets,
                                    self.seq_buckets, self.page_size, self.pages_per_seq,
                                    None, self.page_table)
        drafts = self.runner.propose(inputs).tolist()
        return [[] if row is None else drafts[row][:k] for row, k in zip(rows, ks)]

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)


__all__ = ["DraftModelProposer"]
