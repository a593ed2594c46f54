"""A pure-Python stand-in for the engine around a real Scheduler: a fake clock, and a fake
KV cache whose "model" reads back the pages it wrote, so a resume that restores the wrong
KV (a swap bug, a skipped recompute) changes the output tokens."""

from __future__ import annotations

import zlib

from serving.core.config import SchedulerConfig
from serving.core.kv_cache_manager import KVCacheManager
from serving.core.request import Request, RequestStatus, SamplingParams
from serving.core.scheduler import Scheduler
from serving.core.scheduler_output import SchedulerOutput
from serving.core.swap import SwapManager

VOCAB = 50


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeEngine:
    """schedule -> swaps -> 'run' (write KV slots, read them back to sample) -> finish."""

    def __init__(self, num_pages=64, page_size=4, num_host_pages=0, swap_min_tokens=0,
                 step_seconds=0.01, caching=False, **config):
        config.setdefault("max_num_seqs", 8)
        config.setdefault("max_num_batched_tokens", 32)
        config.setdefault("max_model_len", 256)
        config.setdefault("watermark", 0.0)
        config.setdefault("kv_plan_limit", 1.0)
        self.clock = FakeClock()
        self.page_size = page_size
        self.scheduler = Scheduler(
            SchedulerConfig(**config), KVCacheManager(num_pages, page_size, caching),
            swap=SwapManager(num_host_pages, swap_min_tokens), clock=self.clock)
        self.kv: list[list[int | None]] = [[None] * page_size for _ in range(num_pages)]
        self.host: dict[int, list[int | None]] = {}
        self.step_seconds = step_seconds
        self.admitted: list[str] = []  # request ids in order of first admission
        self.outputs: dict[str, list[int]] = {}

    def add(self, rid: str, num_prompt: int, max_tokens: int = 4, priority: int = 0,
            first_token: int = 1) -> Request:
        prompt = [(first_token + i) % VOCAB for i in range(num_prompt)]
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens),
                          arrival_time=self.clock.now, priority=priority)
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        for device, host in out.swap_out:
            self.host[host] = list(self.kv[device])
        for host, device in out.swap_in:
            self.kv[device] = self.host.pop(host)
        for host in out.host_pages_freed:
            self.host.pop(host, None)
        for seq in out.scheduled:
            if seq.request.metrics.first_scheduled_time == self.clock.now \
                    and seq.request.request_id not in self.admitted:
                self.admitted.append(seq.request.request_id)
            self._write(seq.request, seq.start, seq.num_new_tokens)
        self.scheduler.update_after_step(out)
        for seq in out.scheduled:
            if seq.samples and not seq.request.is_finished:
                self._sample(seq.request)
        self.clock.advance(self.step_seconds)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished:
                return
            self.step()
        raise AssertionError("requests did not finish")

    def _write(self, request: Request, start: int, num: int) -> None:
        for pos in range(start, start + num):
            page = request.page_ids[pos // self.page_size]
            self.kv[page][pos % self.page_size] = request.token_at(pos)

    def _sample(self, request: Request) -> None:
        """The next token is a hash of the KV the request's pages hold (what a model
        attends to), so stale or missing KV shows up in the output."""
        seen = [self.kv[request.page_ids[pos // self.page_size]][pos % self.page_size]
                for pos in range(request.num_computed_tokens)]
        token = zlib.crc32(repr(seen).encode()) % VOCAB
        request.append_output_token(token)
        self.outputs.setdefault(request.request_id, []).append(token)
        if self.scheduler.is_length_capped(request):
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_LENGTH_CAPPED)
