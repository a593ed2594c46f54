"""Self-protection under pressure ("auto-degradation"). Pure Python; the scheduler reads
it once per step with the time of its clock.

- KV pressure: KV usage above `degrade_kv_usage` (90%) for `degrade_after` seconds (30)
  lowers the effective `max_num_batched_tokens` to `degraded_token_fraction` of it (at
  least `max_num_seqs`, so every running decode still fits a step) and doubles the
  admission headroom (watermark 5% -> 10%). Fewer prefill tokens per step means fewer
  admissions and shorter steps for the running requests. It is restored with
  hysteresis: only after usage stayed below `restore_kv_usage` (80%) for
  `restore_after` seconds (30).
- Queue wait: a waiting request not yet admitted that waited longer than `boost_wait`
  (0.2 s) is boosted one level (serving/core/policies.py says what a level is per policy).

Each switch (degraded on / off, boosting on / off) is logged once.
"""

from __future__ import annotations

import heapq
import itertools
import logging

from serving.core.config import SchedulerConfig
from serving.core.request import Request

logger = logging.getLogger(__name__)


class KVPressure:
    """The degraded / normal state machine over KV usage samples."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.degraded = False
        self.num_switches = 0
        self._since: float | None = None  # when the condition for the next switch began

    @property
    def max_num_batched_tokens(self) -> int:
        c = self.config
        if not self.degraded:
            return c.max_num_batched_tokens
        return max(c.max_num_seqs, int(c.max_num_batched_tokens * c.degraded_token_fraction))

    @property
    def watermark(self) -> float:
        """Admission headroom: the configured watermark, doubled while degraded."""
        w = self.config.watermark
        return min(2 * w, 0.5) if self.degraded else w

    def observe(self, now: float, kv_usage: float) -> None:
        c = self.config
        if self.degraded:
            condition, hold = kv_usage < c.restore_kv_usage, c.restore_after
        else:
            condition, hold = kv_usage > c.degrade_kv_usage, c.degrade_after
        if not condition:
            self._since = None
            return
        if self._since is None:
            self._since = now
        if now - self._since >= hold:
            self._switch(kv_usage)

    def _switch(self, kv_usage: float) -> None:
        self.degraded = not self.degraded
        self.num_switches += 1
        self._since = None
        c = self.config
        if self.degraded:
            logger.warning(
                "KV usage %.0f%% stayed above %.0f%% for %gs: degraded, "
                "max_num_batched_tokens %d -> %d, admission headroom %.0f%%",
                100 * kv_usage, 100 * c.degrade_kv_usage, c.degrade_after,
                c.max_num_batched_tokens, self.max_num_batched_tokens, 100 * self.watermark)
        else:
            logger.warning(
                "KV usage %.0f%% stayed below %.0f%% for %gs: restored "
                "max_num_batched_tokens %d", 100 * kv_usage, 100 * c.restore_kv_usage,
                c.restore_after, c.max_num_batched_tokens)


class QueueWaitBoost:
    """Finds waiting requests that were never admitted and waited past `boost_wait`.
    A heap by arrival time: each step looks only at requests that are due."""

    def __init__(self, boost_wait: float):
        self.boost_wait = boost_wait
        self.num_boosts = 0
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()
        self._boosted_waiting: set[str] = set()  # boosted and still waiting

    @property
    def active(self) -> bool:
        """Some waiting request waited past the threshold."""
        return bool(self._boosted_waiting)

    def add(self, request: Request) -> None:
        if self.boost_wait != float("inf"):
            heapq.heappush(self._heap, (request.arrival_time, next(self._order), request))

    def due(self, now: float) -> list[Request]:
        """Requests to boost now (each once); the caller boosts them."""
        was_active = self.active
        due = []
        while self._heap and now - self._heap[0][0] > self.boost_wait:
            request = heapq.heappop(self._heap)[2]
            if request.metrics.first_scheduled_time is None and not request.is_finished:
                due.append(request)
                self._boosted_waiting.add(request.request_id)
        self.num_boosts += len(due)
        if self.active and not was_active:
            logger.info("queue wait over %gs: boosting the requests that waited longer",
                           self.boost_wait)
        return due

    def left_queue(self, request: Request) -> None:
        """Admitted or finished: no longer counts as waiting past the threshold."""
        if request.request_id in self._boosted_waiting:
            self._boosted_waiting.discard(request.request_id)
            if not self.active:
                logger.info("queue wait back under %gs: no request waiting to boost",
                               self.boost_wait)
