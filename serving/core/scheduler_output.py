"""What a step's schedule hands the layers below (vLLM's sched/output.py): which requests
run how many tokens from where, who was preempted, and the KV copies to make first."""

from __future__ import annotations

import dataclasses

from serving.core.request import Request


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before the step: positions start..start+num_new-1
    samples: bool  # the chunk reaches the end of the sequence, so a token is sampled
    admitted: bool = False  # admitted from the waiting queue by this step (new or resumed)
    # speculative decoding: the last num_drafts of its tokens are drafts, each verified
    # by a row of its own (after all sequences' rows)
    num_drafts: int = 0


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[str]
    # KV copies to make before the step runs, in this order: (device page, host page)
    # pairs to host, then (host page, device page) pairs back; host pages to forget.
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    host_pages_freed: list[int] = dataclasses.field(default_factory=list)
    num_drafts: int = 0  # draft tokens of all scheduled sequences (speculative decoding)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_rows(self) -> int:
        """Rows of logits the step samples: a sequence's, and one per draft token."""
        return len(self.scheduled) + self.num_drafts

    @property
    def num_admitted(self) -> int:
        return sum(s.admitted for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class StepBuilder:
    """What one `Scheduler.schedule()` call has handed out so far."""

    def __init__(self, budget: int, max_seqs: int):
        self.budget = budget
        self.max_seqs = max_seqs  # sequences it may take (fewer under pipeline stages)
        self.scheduled: dict[str, ScheduledSeq] = {}  # insertion order = batch order
        self.preempted: list[str] = []
        self.deferred: list[Request] = []  # running prefills that yield to waiting requests
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.num_drafts = 0

    def add(self, request: Request, num_new: int, start: int, num_tokens: int | None = None,
            admitted: bool = False, num_drafts: int = 0) -> None:
        """`num_tokens`: the request's num_tokens_with_pending (and drafts), where the
        caller has it."""
        if num_tokens is None:
            num_tokens = request.num_tokens_with_pending
        self.scheduled[request.request_id] = ScheduledSeq(
            request, num_new, start, start + num_new == num_tokens, admitted, num_drafts)
        self.budget -= num_new
        self.num_drafts += num_drafts

    def unschedule(self, request: Request) -> None:
        seq = self.scheduled.pop(request.request_id, None)
        if seq is not None:
            self.budget += seq.num_new_tokens
            self.num_drafts -= seq.num_drafts
