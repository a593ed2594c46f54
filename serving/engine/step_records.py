"""What the engine keeps about a step beside its model inputs: each row's sampling entry
and the rows under a grammar (built before dispatch), the record of a dispatched step
whose tokens the host has not read (`Flight`), and the token counts of a retired one."""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.core.scheduler_output import SchedulerOutput
from serving.engine.output_processor import SeqState
from serving.executor.dispatch import PendingStep
from serving.executor.model_inputs import ModelInputs
from serving.metrics.step_cost import StepShape
from serving.sample.sampling_arrays import PENDING_TOKEN, SamplingEntry, sampling_row


def sampling_entries(out: SchedulerOutput, seqs: dict[str, SeqState]) -> list[SamplingEntry]:
    """Each scheduled sequence's row of the step's sampling arrays, then a row per draft
    token (speculative decoding, in the rows' order of serving/executor/model_inputs.py).
    A sequence keeps one entry and updates what changes per step (the arrays copy it at
    once)."""
    entries = []
    drafts: list[SamplingEntry] = []
    for scheduled in out.scheduled:
        request = scheduled.request
        seq = seqs[request.request_id]
        entry = seq.sampling_entry
        if entry is None:
            params = request.sampling_params
            entry = seq.sampling_entry = SamplingEntry(
                params, seq.seed, 0, (), None, len(request.prompt_token_ids),
                sampling_row(params, seq.seed))
        num_output = len(request.output_token_ids) + request.num_pending_tokens
        num_drafts = scheduled.num_drafts
        for j in range(num_drafts):  # draft row j samples output j, after drafts[:j]
            drafts.append(_entry_at(seq, dataclasses.replace(entry), num_output, j))
        # the sequence's own row samples the token after its drafts
        entries.append(_entry_at(seq, entry, num_output, num_drafts))
    return entries + drafts


def _entry_at(seq: SeqState, entry: SamplingEntry, num_output: int,
              num_drafts: int) -> SamplingEntry:
    """`entry` set for the draw after the sequence's `num_output` tokens and the first
    `num_drafts` of its draft tokens (its output index: their sum)."""
    request = seq.request
    entry.output_index = output_index = num_output + num_drafts
    if seq.blocked_ids:  # eos/stop ids, blocked until min_tokens
        entry.blocked_ids = (seq.blocked_ids if output_index
                             < request.sampling_params.min_tokens else ())
    if seq.uses_penalties:  # the token in flight, if any, is filled on the device
        entry.penalty_tokens = (request.all_token_ids
                                + [PENDING_TOKEN] * request.num_pending_tokens
                                + request.draft_token_ids[:num_drafts])
    return entry


def constrained_rows(out: SchedulerOutput, seqs: dict[str, SeqState], num_guided: int) -> list:
    """(row, guide, its drafts' rows, its drafts) of the sequences that sample this step
    under a grammar (MaskBuilder.submit)."""
    rows: list = []
    if not num_guided:
        return rows
    draft_row = len(out.scheduled)  # draft rows follow the sequences' rows, in order
    for row, scheduled in enumerate(out.scheduled):
        request, num = scheduled.request, scheduled.num_drafts
        seq = seqs.get(request.request_id)
        if scheduled.samples and seq is not None and seq.guide is not None:
            rows.append((row, seq.guide, list(range(draft_row, draft_row + num)),
                         request.draft_token_ids[:num]))
        draft_row += num
    return rows


@dataclasses.dataclass
class Flight:
    """A dispatched step whose tokens the host has not read."""

    out: SchedulerOutput
    pending: PendingStep
    rows: dict[str, int]  # request id -> row, of the requests it samples a token for
    started: float
    batch: ModelInputs  # its host arrays
    claims: list = dataclasses.field(default_factory=list)  # its scored prompt rows' owners


def decode_only(out: SchedulerOutput) -> bool:
    """Whether every sequence of the step decodes (its one new token and its drafts): no
    prompt chunk, whose cost is the same with speculation and without."""
    return all(s.num_new_tokens == 1 + s.num_drafts for s in out.scheduled)


def step_shape(batch: ModelInputs) -> StepShape:
    """Each scheduled sequence's new tokens and its context once they are written."""
    num_seqs = int(batch.num_seqs)
    return StepShape(query_lens=tuple(np.diff(batch.query_start[:num_seqs + 1]).tolist()),
                     context_lens=tuple(batch.kv_lens[:num_seqs].tolist()))


class TokenCounts:
    """A retired step's token stats, whatever its outputs hold (they may hold none:
    FINAL_ONLY, stream_interval): tokens appended, prompts whose first token this is, and
    the previous token's time of each other token, counted by time (a step's tokens
    mostly share one), for the metrics' inter-token latency."""

    __slots__ = ("num_generated", "num_prompt_tokens", "previous_times")

    def __init__(self):
        self.num_generated = self.num_prompt_tokens = 0
        self.previous_times: dict[float, int] = {}

    def add(self, previous_time: float | None, num_prompt_tokens: int) -> None:
        """One appended token; its sequence's previous token came at `previous_time`
        (None: this is its first; a request's prompt counts once, for its first sample)."""
        self.num_generated += 1
        if previous_time is not None:
            self.previous_times[previous_time] = self.previous_times.get(previous_time, 0) + 1
        else:
            self.num_prompt_tokens += num_prompt_tokens
