"""The engine's loop over pipeline stages: D batches in flight (qwen_jax/pipeline.py).

Each engine step is one tick: the scheduler's batch enters virtual stage 0, every batch
in flight moves one virtual stage on, and the batch at the last one leaves with its
sampled tokens. Overlapped (`async_scheduling`, one process), the host reads and
processes a leaving batch's tokens while the next tick runs; serial, before it. A
sequence whose token is in flight or unread is not scheduled (the scheduler's
`pipeline_depth`: D batches, one more overlapped), and each batch takes that share of the
live sequences, so at steady decode every slot holds a batch and no stage idles; with
fewer sequences than batches, some slots run empty (the bubble).

What a batch needs when it leaves (its sampling rows, its grammar rows, the prompt rows
it scores) is kept from when it entered: its sequences do not change while it is in
flight. Sampling rows are built when it leaves, at the tick's sequence bucket.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from serving.core.request import RequestOutput
from serving.core.scheduler_output import SchedulerOutput
from serving.engine.step_records import Flight, constrained_rows, sampling_entries
from serving.executor import distributed
from serving.executor.model_inputs import ModelInputs, build_model_inputs, step_bucket
from serving.sample.sampling_arrays import SamplingEntry, build_sampling_arrays


@dataclasses.dataclass
class InFlight:
    """A batch in the pipeline."""

    out: SchedulerOutput
    batch: ModelInputs
    entries: list[SamplingEntry]  # its rows' sampling entries as they were when it entered
    score: np.ndarray | None  # prompt rows it scores (prompt_logprobs)
    claims: list


@dataclasses.dataclass
class PipelineStats:
    """Ticks run, and the batch slots (virtual stages) and stage-ticks that held no batch."""

    num_ticks: int = 0
    num_busy_slots: int = 0
    num_idle_slots: int = 0
    num_idle_stage_ticks: int = 0

    @property
    def bubble_fraction(self) -> float:
        total = self.num_busy_slots + self.num_idle_slots
        return self.num_idle_slots / total if total else 0.0


class PipelineLoop:
    """The ticks of one engine (its runner: serving/executor/pipeline_runner.py)."""

    def __init__(self, depth: int, num_stages: int, bucket_pairs, overlap: bool = False):
        self.depth, self.num_stages, self.overlap = depth, num_stages, overlap
        self.bucket_pairs = sorted(tuple(p) for p in bucket_pairs)
        self.slots: list[InFlight | None] = [None] * depth  # by virtual stage
        self.stats = PipelineStats()
        # batches in flight at each of the last ticks (bounded: a server ticks for days)
        self.occupancy: collections.deque[int] = collections.deque(maxlen=4096)
        self._unread: Flight | None = None  # overlapped: the last tick's leaving batch

    @property
    def groups(self) -> int:
        """The batches a cycle of a sequence spans: the D in flight, and (overlapped) the
        one that left whose tokens the host reads while the next tick runs."""
        return self.depth + self.overlap

    def step(self, engine) -> list[RequestOutput]:
        """One tick. Overlapped, the tick is dispatched before the last tick's leaving
        batch is read, so the host's work on those tokens runs beside it; serial, the
        tick's own leaving batch is read before the step returns."""
        out = engine.scheduler.schedule()
        entering = None if out.is_empty else self._enter(engine, out)
        slots = [entering, *self.slots[:-1]]
        unread, self._unread = self._unread, None
        self.slots = slots
        if not any(slot is not None for slot in slots):
            return [] if unread is None else engine._retire(unread)
        leaving = self._dispatch(engine, slots)
        if entering is not None:
            for scheduled in out.scheduled:
                if scheduled.samples:
                    scheduled.request.num_pending_tokens += 1
            engine.scheduler.update_after_step(out)
        if self.overlap:
            self._unread, leaving = leaving, unread
        return [] if leaving is None else engine._retire(leaving)

    def _dispatch(self, engine, slots: list[InFlight | None]) -> Flight | None:
        """Start the tick over `slots`; the leaving batch's Flight (None: no batch leaves)."""
        leaving = slots[-1]
        bucket = self.tick_bucket([slot.batch.bucket for slot in slots if slot is not None])
        sampling = self._sampling(engine, leaving, bucket[1])
        runner = engine.runner
        stacked = runner.stack([None if s is None else s.batch for s in slots], bucket)
        if distributed.is_multiprocess():
            distributed.publish_tick(stacked, sampling, bucket)
        started = time.perf_counter()
        pending = runner.dispatch_stacked(stacked, sampling, bucket,
                                          None if leaving is None else leaving.score)
        self._count(slots)
        return None if leaving is None else Flight(leaving.out, pending, {}, started,
                                                   leaving.batch, leaving.claims)

    def tick_bucket(self, buckets: list[tuple[int, int]]) -> tuple[int, int]:
        """The smallest compiled (T, S) that holds each batch in flight."""
        t, s = max(b[0] for b in buckets), max(b[1] for b in buckets)
        return next(p for p in self.bucket_pairs if p[0] >= t and p[1] >= s)

    def _enter(self, engine, out: SchedulerOutput) -> InFlight:
        config = engine.scheduler_config
        buckets = config.token_bucket_sizes, config.seq_bucket_sizes
        batch = build_model_inputs(out, *buckets, engine.page_size, engine.pages_per_seq, None,
                                   engine.page_table, step_bucket(out, *buckets))
        entries = [dataclasses.replace(e) for e in sampling_entries(out, engine._seqs)]
        score, claims = engine._scoring.rows(out, batch, buckets[0])
        return InFlight(out, batch, entries, score, claims)

    def _sampling(self, engine, leaving: InFlight | None, num_seqs: int):
        entries, masks = [], None
        if leaving is not None:
            entries = leaving.entries
            masks = engine._masks.submit(
                constrained_rows(leaving.out, engine._seqs, engine._num_guided), num_seqs)
        return build_sampling_arrays(entries, num_seqs, engine.max_model_len,
                                     engine.model_config.vocab_size,
                                     None if masks is None else masks.result())

    def _count(self, slots: list[InFlight | None]) -> None:
        stats, pp = self.stats, self.num_stages
        busy = [slot is not None for slot in slots]
        stats.num_ticks += 1
        stats.num_busy_slots += sum(busy)
        stats.num_idle_slots += len(busy) - sum(busy)
        # stage s runs virtual stages s, s + P, ...: idle when none of them holds a batch
        stats.num_idle_stage_ticks += sum(not any(busy[s::pp]) for s in range(pp))
        self.occupancy.append(sum(busy))
