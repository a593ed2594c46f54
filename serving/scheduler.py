"""Token-budget continuous batching (vLLM v1's invariant). Pure Python.

There are no prefill/decode phases: every step each request's
num_computed_tokens catches up towards num_tokens within one token budget.
Running requests go first (a decode token or their next prefill chunk), then
waiting ones are admitted while pages stay above the watermark. When a running
request cannot get pages, the lowest-priority / newest running request is
preempted by recompute.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time

from serving.config import SchedulerConfig
from serving.kv_cache_manager import KVCacheManager, cdiv
from serving.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`; the caller should shed load."""


@dataclasses.dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before the step: positions start..start+num_new-1
    samples: bool  # the chunk reaches the end of the sequence, so a token is sampled


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[str]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_manager: KVCacheManager):
        self.config = scheduler_config
        self.kv = kv_manager
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def watermark_pages(self) -> int:
        return int(self.config.watermark * self.kv.num_total_pages)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def max_num_tokens(self, request: Request) -> int:
        """Length at which the request is capped (prompt + max_tokens, at most max_model_len)."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            return self.config.resolved_max_model_len
        return min(request.num_prompt_tokens + max_tokens, self.config.resolved_max_model_len)

    def is_length_capped(self, request: Request) -> bool:
        return request.num_tokens >= self.max_num_tokens(request)

    def add_request(self, request: Request) -> None:
        self._validate(request)
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"waiting queue is full: max_waiting={self.config.max_waiting}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens > self.config.resolved_max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_model_len={self.config.max_model_len}")
        # The last sampled token's KV is never computed, hence the -1.
        pages = cdiv(self.max_num_tokens(request) - 1, self.kv.page_size)
        if pages > self.kv.num_total_pages:
            raise ValueError(
                f"request needs up to {pages} KV pages but the cache has "
                f"num_total_pages={self.kv.num_total_pages}")

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            i = bisect.bisect_right(self.waiting, _priority_key(request), key=_priority_key)
            self.waiting.insert(i, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            # Admitting after a preemption would only thrash the pages just freed.
            self._schedule_waiting(step)
        return SchedulerOutput(scheduled=list(step.scheduled.values()),
                               preempted=step.preempted)

    def _schedule_running(self, step: _Step) -> None:
        for request in list(self.running):
            if step.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if num_new <= 0:
                continue  # waiting for its sampled token to be appended
            if self._allocate_or_preempt(request, num_new, step):
                step.add(request, num_new, request.num_computed_tokens)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _Step) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, request: Request, step: _Step) -> None:
        step.unschedule(request)
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.append(request.request_id)
        self._enqueue(request, front=True)

    def _schedule_waiting(self, step: _Step) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, num_cached = self.kv.get_computed_pages(request)
            num_new = min(request.num_tokens - num_cached, step.budget)
            # The watermark protects running requests' growth; with none running
            # it could only keep a large request waiting forever.
            reserved = self.watermark_pages if self.running else 0
            if not self.kv.allocate_slots(request, num_new, hits, num_reserved_pages=reserved):
                break
            self.waiting.popleft()
            self._admit(request, num_cached)
            step.add(request, num_new, num_cached)

    def _admit(self, request: Request, num_cached: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        request.num_cached_tokens = num_cached
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
        self.running.append(request)

    def update_after_step(self, scheduler_output: SchedulerOutput) -> None:
        """Mark each scheduled chunk computed and register its full pages for reuse.

        The engine appends the sampled token of each `samples` entry afterwards.
        """
        for seq in scheduler_output.scheduled:
            request = seq.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted or finished while the step ran
            request.num_computed_tokens = seq.start + seq.num_new_tokens
            self.kv.cache_pages(request)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Retire a request with a finished status and free its pages at once."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished status, got {status.name}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.metrics.finished_time = time.monotonic()
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class _Step:
    """What one schedule() call has handed out so far."""

    def __init__(self, budget: int):
        self.budget = budget
        self.scheduled: dict[str, ScheduledSeq] = {}  # insertion order = batch order
        self.preempted: list[str] = []

    def add(self, request: Request, num_new: int, start: int) -> None:
        samples = start + num_new == request.num_tokens
        self.scheduled[request.request_id] = ScheduledSeq(request, num_new, start, samples)
        self.budget -= num_new

    def unschedule(self, request: Request) -> None:
        seq = self.scheduled.pop(request.request_id, None)
        if seq is not None:
            self.budget += seq.num_new_tokens
