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


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[str]
    # KV copies to make before the step runs, in this order: (device page, host page)
    # pairs to host, then (host page, device page) pairs back; host pages to forget.
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    host_pages_freed: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_admitted(self) -> int:
        return sum(s.admitted for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
