"""How many drafts each sequence verifies in a step (speculative decoding). Pure Python.

A draft costs a query token in the step and pays only while every draft before it was
kept. With a sequence's per-draft acceptance rate a, its j-th draft adds a^j expected
tokens. The step's cost is a function of its token bucket (the padded shape it runs
at): measured here, as the engine's wall time per step by bucket, so it holds what the
device's roofline would say (a GPU decode reads the same weights for 1 or 8 tokens a
sequence: a larger bucket is nearly free; the union of the experts k + 1 tokens route to
grows with them) and what it leaves out (the host's part, this CPU's compute).

`DraftLengths.choose` adds drafts best gain first (the sequence whose next draft is
likeliest kept) and keeps the number of drafts whose expected tokens per second of step
is highest. A sequence whose drafts keep failing gets none: its a drops below what any
bucket's extra cost pays for. A bucket not yet timed is costed as the largest timed one
below it (so it gets tried, and then timed); a bucket's first step is not used (it may
have compiled).

The acceptance rate a of a sequence: its kept drafts over its verified positions (the
drafts up to and including its first rejection each step), with the engine's rate so
far as a prior worth `PRIOR_WEIGHT` positions.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

PRIOR_WEIGHT = 4.0
EMA = 0.2  # weight of a new step time in its bucket's estimate


class DraftLengths:
    def __init__(self, token_buckets: Sequence[int]):
        self.buckets = tuple(sorted(token_buckets))
        self.seconds: dict[int, float] = {}  # bucket -> step wall seconds (EMA)
        self._seen: set[int] = set()
        self.kept = 0  # the engine's, over every sequence
        self.tested = 0
        self._per_seq: dict[str, list[int]] = {}  # request id -> [kept, tested]

    # ---- what the engine reports ---------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` (padded) tokens took `seconds` of wall time."""
        bucket = self.bucket(num_tokens)
        if bucket not in self._seen:  # its first run may have compiled
            self._seen.add(bucket)
            return
        old = self.seconds.get(bucket)
        self.seconds[bucket] = seconds if old is None else old + EMA * (seconds - old)

    def observe_verify(self, request_id: str, num_drafts: int, kept: int) -> None:
        tested = min(num_drafts, kept + 1)
        counts = self._per_seq.setdefault(request_id, [0, 0])
        counts[0] += kept
        counts[1] += tested
        self.kept += kept
        self.tested += tested

    def forget(self, request_id: str) -> None:
        self._per_seq.pop(request_id, None)

    # ---- the choice ------------------------------------------------------------------
    def acceptance(self, request_id: str) -> float:
        """The sequence's per-draft acceptance rate (estimated)."""
        prior = (self.kept + 1) / (self.tested + 2)
        kept, tested = self._per_seq.get(request_id, (0, 0))
        return (kept + PRIOR_WEIGHT * prior) / (tested + PRIOR_WEIGHT)

    def bucket(self, num_tokens: int) -> int:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def cost(self, num_tokens: int) -> float:
        """Seconds of a step of `num_tokens` tokens: its bucket's, else the largest timed
        bucket's below it (else above it; 1.0 while nothing is timed)."""
        bucket = self.bucket(num_tokens)
        if bucket in self.seconds:
            return self.seconds[bucket]
        timed = sorted(self.seconds)
        if not timed:
            return 1.0
        below = [b for b in timed if b < bucket]
        return self.seconds[below[-1] if below else timed[0]]

    def choose(self, candidates: Sequence[tuple[str, int]], num_other_tokens: int
               ) -> list[int]:
        """The number of drafts to verify for each (request id, drafts proposed), in a step
        with `num_other_tokens` tokens besides the drafts (each candidate's own token
        among them)."""
        rates = [self.acceptance(request_id) for request_id, _ in candidates]
        heap = [(-rate, i, 1) for i, ((_, num), rate) in enumerate(zip(candidates, rates))
                if num > 0]
        heapq.heapify(heap)
        tokens, expected = num_other_tokens, float(num_other_tokens)
        best, best_value, order = 0, expected / self.cost(tokens), []
        while heap:
            gain, i, j = heapq.heappop(heap)
            order.append(i)
            tokens, expected = tokens + 1, expected - gain
            value = expected / self.cost(tokens)
            if value > best_value:
                best, best_value = len(order), value
            if j < candidates[i][1]:
                heapq.heappush(heap, (-(rates[i] ** (j + 1)), i, j + 1))
        counts = [0] * len(candidates)
        for i in order[:best]:
            counts[i] += 1
        return counts


class SpeculationSwitch:
    """Whether the engine speculates at all this step, by measurement: output tokens per
    second of wall time in steps that speculate (serial: the next step's input depends
    on the drafts kept) against steps that do not (the overlapped loop where it runs).
    Kept per load class (running sequences rounded up to a power of two): a batch of 1
    on a GPU bound by weight reads gains from drafts, a batch of 64 computing on a CPU may
    lose the overlap's worth. The mode measured faster runs; the other is tried again
    for `PROBE_STEPS` steps after `EXPLORE_EVERY` steps in the faster one (loads change),
    the first step after a switch not counted (it finishes the other mode's step in
    flight). A probe that leaves the choice as it was doubles the steps to the next, up
    to `MAX_EXPLORE_EVERY`: probing a mode three times slower (fixed drafts at batch 8 on
    this CPU) every 64 steps spends 27% of the time there, every 1024 steps 2%. A probe
    that changes the choice starts the count again at `EXPLORE_EVERY`."""

    EXPLORE_EVERY = 64
    MAX_EXPLORE_EVERY = 1024
    PROBE_STEPS = 8

    def __init__(self):
        self._classes: dict[int, _ModeRates] = {}
        self.speculating = True
        self._skip = False

    def choose(self, num_running: int) -> bool:
        """The mode of the next step (True: speculate)."""
        load = 1 << max(num_running - 1, 0).bit_length()
        rates = self._classes.setdefault(load, _ModeRates())
        mode = rates.next_mode()
        self._skip = mode != self.speculating
        self.speculating, self._rates = mode, rates
        return mode

    def observe(self, num_tokens: int, seconds: float, decode_only: bool = True) -> None:
        """The step just chosen emitted `num_tokens` output tokens in `seconds`;
        `decode_only`: no sequence of it took a prompt chunk. A step with one is not
        counted: the chunk costs the same in either mode, and on this CPU a 12-17 ms
        prefill step emitting a batch of 8 first tokens would be scored in whichever mode
        it fell, turning the comparison of the decode steps."""
        if not self._skip and decode_only and seconds > 0 and num_tokens:
            self._rates.add(self.speculating, num_tokens, seconds)


class _ModeRates:
    def __init__(self):
        self.rate: dict[bool, float] = {}  # mode -> output tokens/s
        self._sums: dict[bool, tuple[float, float]] = {}  # mode -> decayed tokens, seconds
        self.samples = {True: 0, False: 0}
        self.interval = SpeculationSwitch.EXPLORE_EVERY  # faster-mode steps between probes
        self.steps = 0  # steps in the faster mode since this class last probed
        self._probe_left = 0  # steps of the probe under way still to run
        self._probed_against: bool | None = None  # the faster mode when the probe began

    def next_mode(self) -> bool:
        for mode in (True, False):  # each measured first, speculation first
            if self.samples[mode] < SpeculationSwitch.PROBE_STEPS:
                return mode
        if self._probe_left:
            self._probe_left -= 1
            return not self._probed_against
        best = self.rate[True] >= self.rate[False]
        if self._probed_against is not None:  # a probe just ended
            kept = best == self._probed_against
            self.interval = (min(2 * self.interval, SpeculationSwitch.MAX_EXPLORE_EVERY)
                             if kept else SpeculationSwitch.EXPLORE_EVERY)
            self._probed_against = None
        self.steps += 1
        if self.steps <= self.interval:
            return best
        self.steps = 0
        self._probed_against, self._probe_left = best, SpeculationSwitch.PROBE_STEPS - 1
        return not best

    def add(self, mode: bool, tokens: int, seconds: float) -> None:
        """A step's tokens and time. The rate is the ratio of their decayed sums, tokens
        per second over the recent steps, not an average of each step's own rate (which
        weights a short step as much as a long one)."""
        self.samples[mode] += 1
        old_tokens, old_seconds = self._sums.get(mode, (0.0, 0.0))
        kept = 1 - EMA
        sums = (kept * old_tokens + tokens, kept * old_seconds + seconds)
        self._sums[mode] = sums
        self.rate[mode] = sums[0] / sums[1]


__all__ = ["DraftLengths", "SpeculationSwitch"]
