"""Token-budget continuous batching (vLLM v1's invariant). Pure Python.

There are no prefill/decode phases: every step each request's
num_computed_tokens catches up towards num_tokens within one token budget. With the
overlapped engine loop a request's num_tokens includes the token its last step sampled
on the device (`num_pending_tokens`): it is scheduled as that token's input before the
host has read it.
Running requests go first (a decode token or their next prefill chunk), then
waiting ones are admitted in the policy's order (serving/core/policies.py) while pages
stay above the admission headroom. When a running request cannot get pages, the
lowest-priority / newest running request is preempted: its pages are copied to host
memory when swap space allows (serving/core/swap.py), else recomputed later.

Length-aware extras: a running request's prefill chunk waits behind waiting requests
that rank above it (it gets the budget they leave), and a short request that waited
past `short_preempt_wait` may take the place of a running long one that ranks below it.
The prefill cap (serving/core/prefill_cap.py; by default under length-aware only) bounds
each request's chunk and how many long prompts prefill at once: a long prompt waiting
for that slot keeps its place while the requests behind it that need none are admitted.
Self-protection (serving/core/degradation.py) sets the step's budget and admission headroom.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from serving.core.config import SchedulerConfig
from serving.core.degradation import KVPressure, QueueWaitBoost
from serving.core.kv_cache_manager import KVCacheManager, cdiv
from serving.core.lora_slots import LoRASlots
from serving.core.page_pool import Page
from serving.core.policies import OrderPolicy, WaitingQueue
from serving.core.prefill_cap import PrefillCap
from serving.core.request import Request, RequestStatus
from serving.core.scheduler_output import ScheduledSeq, SchedulerOutput, StepBuilder
from serving.core.speculative import fit_draft_rows
from serving.core.swap import SwapManager


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`; the caller should shed load."""


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_manager: KVCacheManager,
                 swap: SwapManager | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`clock` must be the clock of the requests' arrival times (tests fake both)."""
        self.config = scheduler_config
        self._max_model_len = scheduler_config.max_model_len  # None until resolved
        self.kv = kv_manager
        self.swap = swap or SwapManager()
        self.clock = clock
        self.prefill_cap = PrefillCap(scheduler_config)
        self.policy = OrderPolicy(scheduler_config.policy, scheduler_config.length_buckets,
                                  scheduler_config.aging_interval)
        self.pressure = KVPressure(scheduler_config)
        self.boost = QueueWaitBoost(
            scheduler_config.boost_wait if self.policy.boosts else float("inf"))
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed KV thrown away by recompute preemptions
        self.lora: LoRASlots | None = None  # adapter slots (the engine's, with LoRA on)
        # Batches in flight at once (pipeline stages, serving/engine/pipeline.py): a
        # request whose token is in flight waits for it, and each batch takes about
        # 1/depth of the live requests.
        self.pipeline_depth = 1

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
        return int(self.pressure.watermark * self.kv.num_total_pages)

    @property
    def max_num_batched_tokens(self) -> int:
        """The step's token budget: max_num_batched_tokens, lowered while degraded."""
        return self.pressure.max_num_batched_tokens

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def max_num_tokens(self, request: Request) -> int:
        """Length at which the request is capped (prompt + max_tokens, at most max_model_len);
        kept on the request once it is added."""
        if request.max_num_tokens:
            return request.max_num_tokens
        max_tokens = request.sampling_params.max_tokens
        limit = self._max_model_len or self.config.resolved_max_model_len
        if max_tokens is None:
            return limit
        return min(len(request.prompt_token_ids) + max_tokens, limit)

    def is_length_capped(self, request: Request) -> bool:
        return request.num_tokens >= self.max_num_tokens(request)

    def add_request(self, request: Request) -> None:
        self._validate(request)
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"waiting queue is full: max_waiting={self.config.max_waiting}")
        request.status = RequestStatus.WAITING
        request.max_num_tokens = self.max_num_tokens(request)
        self.requests[request.request_id] = request
        self._enqueue(request)
        self.boost.add(request)

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
        self.waiting.push(request, front)

    def schedule(self) -> SchedulerOutput:
        now = self.observe_pressure()
        for request in self.boost.due(now):
            self.waiting.boost(request)
        live = len(self.running) + len(self.waiting)  # the cap binds under stages alone
        step = StepBuilder(self.pressure.max_num_batched_tokens, -(-live // self.pipeline_depth))
        self._schedule_running(step)
        if not step.preempted:
            # Admitting after a preemption would only thrash the pages just freed.
            self._schedule_waiting(step, now)
        self._schedule_deferred(step)
        if step.num_drafts:
            cut = fit_draft_rows(list(step.scheduled.values()),
                                 max(self.config.seq_bucket_sizes))
            step.budget, step.num_drafts = step.budget + cut, step.num_drafts - cut
        step.budget += self.prefill_cap.trim(list(step.scheduled.values()))
        return SchedulerOutput(scheduled=list(step.scheduled.values()),
                               preempted=step.preempted, swap_out=step.swap_out,
                               swap_in=step.swap_in, host_pages_freed=self.swap.take_released(),
                               num_drafts=step.num_drafts)

    def observe_pressure(self) -> float:
        """Sample KV usage for degradation (every step; the engine also samples it when it
        reports stats, so an idle engine restores its budget). Returns the time."""
        now = self.clock()
        self.pressure.observe(now, self.kv.usage)
        return now

    def _schedule_running(self, step: StepBuilder) -> None:
        head = self.waiting.head if self.waiting else None
        running, page_size = RequestStatus.RUNNING, self.kv.page_size
        scheduled = step.scheduled
        for request in list(self.running):
            if step.budget == 0 or len(scheduled) >= step.max_seqs:
                break
            if request.status != running:
                continue  # preempted earlier in this step
            pending = request.num_pending_tokens
            num_tokens = (len(request.prompt_token_ids) + len(request.output_token_ids)
                          + pending)
            num_left = num_tokens - request.num_computed_tokens
            if num_left <= 0 or pending and (self.pipeline_depth > 1 or num_tokens >= (
                    request.max_num_tokens or self.max_num_tokens(request))):
                # waiting for its sampled token (in the pipeline, or the serial loop's),
                # or (overlapped loop) the token still on the device is its last by
                # length: the engine finishes it on reading
                continue
            if num_left > 1 and head is not None and self.policy.yields_to(request, head):
                step.deferred.append(request)  # its prefill gets what admissions leave
                continue
            if num_left == 1:
                num_new = 1
                start = request.num_computed_tokens
                if request.draft_token_ids:  # its token and the drafts after it
                    num_drafts = min(len(request.draft_token_ids), step.budget - 1)
                    if self._allocate_or_preempt(request, 1 + num_drafts, step):
                        step.add(request, 1 + num_drafts, start, num_tokens + num_drafts,
                                 num_drafts=num_drafts)
                    continue
                if start < len(request.page_ids) * page_size:
                    # a decode whose pages hold its next token (allocate_slots' fast path;
                    # step.add, inlined: this runs per running request per step)
                    scheduled[request.request_id] = ScheduledSeq(request, 1, start, True)
                    step.budget -= 1
                    continue
            else:
                num_new = self.prefill_cap.chunk(num_left, step.budget)
            if self._allocate_or_preempt(request, num_new, step):
                step.add(request, num_new, request.num_computed_tokens, num_tokens)

    def _schedule_deferred(self, step: StepBuilder, head: Request | None = None) -> None:
        """Prefill chunks that yielded to waiting requests, once those that rank above them
        are admitted: the ones that rank no lower than `head` (all when None). Never
        preempts."""
        for request in list(step.deferred):
            if step.budget == 0 or len(step.scheduled) >= step.max_seqs:
                break
            if head is not None and self.policy.key(request) > self.policy.key(head):
                continue
            step.deferred.remove(request)
            if request.status != RequestStatus.RUNNING:
                continue  # preempted for a short request
            num_new = self.prefill_cap.chunk(
                request.num_tokens_with_pending - request.num_computed_tokens, step.budget)
            if self.kv.allocate_slots(request, num_new):
                step.add(request, num_new, request.num_computed_tokens)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: StepBuilder) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _pick_victim(self) -> Request:
        if self.policy.sorted:
            return max(self.running, key=self.policy.key)
        return self.running[-1]

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        step.unschedule(request)
        self.running.remove(request)
        if self.lora is not None:
            self.lora.release(request)
        self._swap_out_or_drop(request, step)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.append(request.request_id)
        self._enqueue(request, front=True)

    def _swap_out_or_drop(self, request: Request, step: StepBuilder) -> None:
        """Copy the computed pages to host when swap space allows, else recompute later."""
        computed = request.num_computed_tokens
        num_pages = cdiv(computed, self.kv.page_size)
        if self.swap.should_swap(computed, num_pages):
            step.swap_out += self.swap.swap_out(request.request_id,
                                                request.page_ids[:num_pages], computed)
        else:
            self.num_recomputed_tokens += computed
        self.kv.free(request)

    def _schedule_waiting(self, step: StepBuilder, now: float) -> None:
        """Admit in the queue's order until one cannot be admitted; a long prompt waiting
        for a long-prefill slot stays in its place and the ones behind it go on."""
        growth: int | None = None  # the running requests' next-token pages, when needed
        num_skipped = 0
        while (len(self.waiting) > num_skipped and step.budget > 0
               and len(step.scheduled) < step.max_seqs):
            request = self.waiting[num_skipped]
            if request.request_id in step.preempted or request.num_pending_tokens:
                # preempted in this step: resuming it now would only thrash (and its
                # last sampled token is not on the host yet)
                break
            if growth is None:
                growth = self._next_token_growth(self.running, step)
            self._schedule_deferred(step, head=request)
            if step.budget == 0:
                break
            if self.lora is not None and self.lora.slot_for(request) is None:
                num_skipped += 1  # its adapter is loading or has no slot yet: it waits
                continue
            saved = self.swap.num_saved_tokens(request.request_id)
            hits, num_cached = ([], saved) if saved else self.kv.get_computed_pages(request)
            if self.prefill_cap.waits_for_slot(request.num_tokens - num_cached, self.running):
                num_skipped += 1
            elif self._try_admit(request, step, growth, hits, num_cached):
                growth += self._next_token_growth([request], step)
            elif not self._preempt_for_short(request, step, now):
                break

    def _try_admit(self, request: Request, step: StepBuilder, growth: int, hits: list[Page],
                   num_cached: int) -> bool:
        """Admit with `num_cached` tokens already computed: prefix-cache `hits`, or as many
        saved in host memory (no hits) for a swapped-out request."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        saved = self.swap.num_saved_tokens(request.request_id)
        num_new = self.prefill_cap.chunk(request.num_tokens - num_cached, step.budget)
        # The headroom protects running requests' growth; with none running it could
        # only keep a large request waiting forever.
        reserved = self._admission_reserve(growth) if self.running else 0
        if saved:  # swapped out: pages for its saved KV too, filled by the swap-in
            ok = self.kv.allocate_slots(request, saved + num_new, num_reserved_pages=reserved)
        else:
            ok = self.kv.allocate_slots(request, num_new, hits, num_reserved_pages=reserved)
        if not ok:
            return False
        self.waiting.remove(request)
        if saved:
            step.swap_in += self.swap.swap_in(
                request.request_id, request.page_ids[:cdiv(saved, self.kv.page_size)])
        self._admit(request, num_cached, from_prefix_cache=not saved)
        step.add(request, num_new, num_cached, admitted=True)
        return True

    def _admission_reserve(self, growth: int) -> int:
        """Pages that must stay free after an admission: the headroom (watermark), and
        enough that what is held, handed out and needed by running requests' next tokens
        (`growth`) stays within kv_plan_limit of the pages (1: no such plan)."""
        limit = self.config.kv_plan_limit
        if limit >= 1:
            return self.watermark_pages  # no plan: overcommit as vLLM does
        total = self.kv.num_total_pages
        return max(self.watermark_pages, total - int(limit * total) + growth)

    def _next_token_growth(self, requests: list[Request], step: StepBuilder) -> int:
        """New pages these requests need to compute one token past this step."""
        growth = 0
        for request in requests:
            seq = step.scheduled.get(request.request_id)
            end = request.num_computed_tokens + (seq.num_new_tokens if seq else 0)
            growth += max(0, cdiv(end + 1, self.kv.page_size) - len(request.page_ids))
        return growth

    def _preempt_for_short(self, request: Request, step: StepBuilder, now: float) -> bool:
        victim = self.policy.short_preempts(
            request, self.running, now - request.arrival_time > self.config.short_preempt_wait)
        if victim is not None:
            self._preempt(victim, step)
        return victim is not None

    def _admit(self, request: Request, num_computed: int, from_prefix_cache: bool) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if from_prefix_cache:
            request.num_cached_tokens = num_computed
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = self.clock()
        self.boost.left_queue(request)
        if self.lora is not None:
            self.lora.acquire(request, self.lora.slot_for(request) or 0)
        self.running.append(request)

    def update_after_step(self, scheduler_output: SchedulerOutput,
                          rejected: Mapping[str, int] | None = None) -> None:
        """Mark each scheduled chunk computed and register its full pages for reuse.

        The engine appends the sampled token of each `samples` entry afterwards, or (with
        drafts) first: `rejected` gives the draft tokens per request that verification
        dropped, whose KV is not the sequence's (their slots are written again).
        """
        page_size, caching = self.kv.page_size, self.kv.enable_prefix_caching
        running = RequestStatus.RUNNING
        for seq in scheduler_output.scheduled:
            request = seq.request
            if request.status != running:
                continue  # aborted or finished while the step ran
            end = seq.start + seq.num_new_tokens
            if rejected and seq.num_drafts:
                end -= rejected.get(request.request_id, 0)
            request.num_computed_tokens = end
            # Pages fill only where a chunk crosses a page end; an admission may bring
            # full pages of its own (prefix hits are cached already, swapped-in ones not).
            if caching and (seq.admitted or end // page_size != seq.start // page_size):
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
            if self.lora is not None:
                self.lora.release(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        self.kv.free(request)
        self.swap.drop(request_id)
        self.policy.forget(request)
        self.boost.left_queue(request)
        request.status = status
        request.metrics.finished_time = self.clock()
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)
