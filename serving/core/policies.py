"""The waiting queue's order: fcfs, priority and length-aware with aging. Pure Python.

Length-aware: a request's prompt length puts it in a length class (short < 128 <= medium
< 512 <= long, the `length_buckets` bounds); short requests rank two levels above long
ones, medium one. A waiting request gains one level per `aging_interval` seconds of
waiting. Ranking by `level + waited / aging_interval` is the same at every instant as
ranking by the static key `arrival_time + (short level - level) * aging_interval`, so
the queue stays a sorted list and nothing is re-sorted as time passes.

The bound this gives, under any arrival pattern: no request is ever admitted ahead of
a request that arrived more than `2 * aging_interval` seconds before it (one interval
for medium ones, none for short ones: short requests are first come, first served).
Once a request has waited two intervals, only requests that arrived before it can still
be admitted ahead of it, so no stream of later arrivals starves it. (Admission is in
strict key order: the queue's head blocks the rest, and a running request is preempted
for a waiting one only if it ranks below it.) One exception, by design: a prompt that
waits for a long-prefill slot (serving/core/scheduler.py) lets the requests behind it that
need none go first; among those that need one the order and the bound hold, and a
slot frees as soon as a running prompt has less than one capped chunk left.

A queue-wait boost (`boost_wait`, see serving/core/degradation.py) raises a request by one
level: under priority its priority value counts one lower, under length-aware its key
one `aging_interval` earlier. Every boosted request moves by the same step, so boosts
never reorder two requests that both waited past the threshold, and the bound above
still holds. FCFS already serves the longest-waiting request first: it boosts nothing.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator

from serving.core.config import LENGTH_AWARE
from serving.core.request import Request

SHORT, MEDIUM, LONG = 0, 1, 2
LENGTH_CLASS_NAMES = ("short", "medium", "long")


def length_class(num_prompt_tokens: int, bounds: tuple[int, ...]) -> int:
    """SHORT, MEDIUM or LONG: bounds (128, 512) put 127 in short, 128 and 511 in medium."""
    return bisect.bisect_right(bounds, num_prompt_tokens)


class OrderPolicy:
    """Sort keys of waiting requests (smaller first) and which running request yields."""

    def __init__(self, policy: str, length_buckets: tuple[int, ...] = (128, 512),
                 aging_interval: float = 1.0):
        self.name = policy
        self.length_buckets = length_buckets
        self.aging_interval = aging_interval
        self.boosted: set[str] = set()

    @property
    def is_length_aware(self) -> bool:
        return self.name == LENGTH_AWARE

    @property
    def boosts(self) -> bool:
        return self.name != "fcfs"

    @property
    def sorted(self) -> bool:
        return self.name != "fcfs"

    def length_class(self, request: Request) -> int:
        return length_class(request.num_prompt_tokens, self.length_buckets)

    def key(self, request: Request) -> tuple[float, ...]:
        boost = 1 if request.request_id in self.boosted else 0
        if self.name == "priority":
            return (request.priority - boost, request.arrival_time)
        if self.name == LENGTH_AWARE:
            return (request.arrival_time
                    + (self.length_class(request) - boost) * self.aging_interval,)
        return (request.arrival_time,)

    def yields_to(self, running: Request, waiting: Request) -> bool:
        """Whether `running` should let `waiting` go first (length-aware only): its key
        is later. Never true for a request that has aged past the waiting one."""
        return self.is_length_aware and self.key(running) > self.key(waiting)

    def short_preempts(self, request: Request, running: list[Request],
                       waited_long: bool) -> Request | None:
        """Length-aware: the running long request that a short `request` which waited past
        short_preempt_wait (`waited_long`) may take the place of (the one that ranks last,
        if it ranks below `request`); None when there is none."""
        if not (self.is_length_aware and waited_long and self.length_class(request) == SHORT):
            return None
        victims = [r for r in running
                   if self.length_class(r) == LONG and self.yields_to(r, request)]
        return max(victims, key=self.key) if victims else None

    def forget(self, request: Request) -> None:
        self.boosted.discard(request.request_id)


class WaitingQueue:
    """Waiting requests in scheduling order: a deque under fcfs (preempted requests go
    back to the front), a list sorted by the policy's key otherwise."""

    def __init__(self, policy: OrderPolicy):
        self.policy = policy
        self._items: collections.deque[Request] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    @property
    def head(self) -> Request:
        return self._items[0]

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy.sorted:
            i = bisect.bisect_right(self._items, self.policy.key(request), key=self.policy.key)
            self._items.insert(i, request)
        elif front:
            self._items.appendleft(request)
        else:
            self._items.append(request)

    def popleft(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def boost(self, request: Request) -> None:
        """Raise a waiting request by one level and move it to its new place."""
        self._items.remove(request)
        self.policy.boosted.add(request.request_id)
        self.push(request)
