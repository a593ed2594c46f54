"""Speculative decoding in the engine: n-gram drafts verified in the continuous batch.

Before each schedule the engine proposes drafts for its decoding sequences
(`Speculator.propose`: serving/core/speculative.py's n-gram lookup over each sequence's
own tokens). The scheduler runs a sequence with d drafts as d + 1 query tokens (its
last token, then the drafts); the step samples d + 1 rows for it: its own row (the
chunk's last token) and one per draft (serving/executor/model_inputs.py). The engine
keeps the drafts while each equals the token the target model gives at its position,
then takes the target's token at the first mismatch, or its row's token after all d
(`Speculator.verify`); the rejected drafts' KV is rolled back by the scheduler
(`Scheduler.update_after_step(rejected=...)`).

Lossless: a row samples as the plain engine would at its position (its sequence's
temperature, top-k/top-p/min-p, penalties over the tokens before it, drafts included,
min_tokens, its draw's output index), so each row's token is a draw from the target's
distribution there; the drafts are kept while each equals its row's token. For an
n-gram draft (a single token, probability 1 in the draft's distribution) this is
rejection sampling exactly: accepted with probability p(draft), else a token from p
without the draft, renormalised. Since the draws are a function of (seed, output
index), a seeded request gives the same tokens with speculation as without. Greedy rows
take the argmax. Under a grammar, a sequence's drafts stop before the first its grammar
does not allow, and draft row j's mask is the grammar's state after drafts 0..j
(serving/structured_output/token_mask.py), so each row samples as the plain engine would.

A draft model's or EAGLE-3 head's drafts stay on the device (`DeviceDrafts`): the
proposal is dispatched, the step is scheduled and its inputs built while it computes,
and the verify step takes the drafts from the proposal's output as an overlapped step
takes its previous step's tokens (`prev_index` into `prev_tokens`); the host reads them
with the step's tokens, one wait a step. A step with a sequence under a grammar or with
repetition penalties, whose draft rows need the drafts on the host first (the grammar's
masks, the penalised tokens), waits for its drafts instead.

How many drafts each sequence verifies, and whether a step speculates at all:
serving/core/draft_length.py (per-sequence acceptance against the measured cost of each
step bucket; output tokens/s of decode-only steps measured with and without
speculation), unless
`adaptive_draft_length` is off. A step that speculates runs serially (the next step's
input depends on how many drafts were kept); the others run in the plain loop,
overlapped where it would be.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from serving.core.draft_length import DraftLengths, SpeculationSwitch
from serving.core.request import Request
from serving.core.scheduler_output import SchedulerOutput
from serving.core.speculative import SpeculativeConfig, propose_ngram
from serving.engine.draft_proposer import DraftModelProposer
from serving.engine.output_processor import SeqState


def grammar_drafts(seq: SeqState, drafts: list[int]) -> list[int]:
    """The drafts up to the first its grammar does not allow (all without one)."""
    return drafts if seq.guide is None else drafts[:seq.guide.valid_prefix(drafts)]


@dataclasses.dataclass
class DeviceDrafts:
    """A dispatched proposal whose drafts the host has not read: the flat drafts on the
    device (int32[prev_width], DraftRunner.dispatch) and where each request's drafts start."""

    tokens: jax.Array
    offsets: dict[str, int]  # request id -> its first draft's index in `tokens`

    def fill(self, out: SchedulerOutput) -> None:
        """Replace the placeholder drafts of the step's sequences by the proposal's."""
        host = np.asarray(self.tokens)
        for scheduled in out.scheduled:
            request, num = scheduled.request, scheduled.num_drafts
            offset = self.offsets.get(request.request_id)
            if num and offset is not None:
                request.draft_token_ids[:num] = host[offset:offset + num].tolist()


class Speculator:
    """Proposes drafts and verifies them; counts what vLLM's spec-decode metrics count."""

    def __init__(self, config: SpeculativeConfig, token_buckets: tuple[int, ...],
                 draft: DraftModelProposer | None = None):
        self.config = config
        self.draft = draft  # method draft_model: the draft model's proposer
        k = config.num_speculative_tokens
        adaptive = config.adaptive_draft_length
        self.lengths = DraftLengths(token_buckets) if adaptive else None
        self.switch = SpeculationSwitch() if adaptive else None
        self.active = True  # whether this step speculates (else the plain loop runs it)
        self.num_steps = {True: 0, False: 0}  # engine steps begun speculating / not
        self.num_drafts = 0           # verify steps of a sequence with drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k
        self.rejected: dict[str, int] = {}  # the last verified step's, by request id
        self.on_device: DeviceDrafts | None = None  # this step's drafts, when not on the host
        self.keep_drafts_on_device = True  # False: the host waits for every proposal
        self.num_device_proposals = 0  # steps whose drafts stayed on the device
        self._began = 0.0

    def begin_step(self, running: list[Request]) -> float:
        """Chooses whether the step about to run speculates (`active`); returns its start."""
        was_active = self.active
        self.active = self.switch is None or self.switch.choose(len(running))
        self.num_steps[self.active] += 1
        if was_active and not self.active:  # drafts proposed but not run are dropped
            for request in running:
                request.draft_token_ids = []
            self.on_device = None
        return time.perf_counter()

    def end_step(self, began: float, step: dict) -> None:
        """The step begun at `began` ended; `step`: the engine's `last_step` (tokens it
        appended; whether the steps it dispatched and retired only decoded)."""
        if self.switch is not None:
            self.switch.observe(step.get("num_generated", 0), time.perf_counter() - began,
                                decode_only=bool(step.get("decode_only")))

    def propose(self, running: list[Request], seqs: dict[str, SeqState]) -> None:
        """Sets each running decoding sequence's draft tokens (none for the others)."""
        self._began = time.perf_counter()  # the step's start: see verify
        self.on_device = None
        eligible: list[tuple[Request, int, SeqState]] = []
        for request in running:
            request.draft_token_ids = []
            seq = seqs.get(request.request_id)
            num_tokens = request.num_tokens
            if (seq is None or request.num_computed_tokens != num_tokens - 1
                    or request.num_pending_tokens):
                continue
            # room for the drafts and the token after them within max_tokens / the model
            room = (request.max_num_tokens or num_tokens + 1) - num_tokens - 1
            k = min(self.config.num_speculative_tokens, room)
            if k > 0:
                eligible.append((request, k, seq))
        if self.draft is not None and self.keep_drafts_on_device and eligible and not any(
                seq.guide is not None or seq.uses_penalties for _, _, seq in eligible):
            self._propose_on_device(eligible, len(running))
            return
        proposed = []
        for (request, _, seq), drafts in zip(eligible, self._drafts(eligible)):
            drafts = grammar_drafts(seq, drafts)
            if drafts:
                request.draft_token_ids = drafts
                proposed.append(request)
        counts = self._counts([(r.request_id, len(r.draft_token_ids)) for r in proposed],
                              len(running))
        for request, count in zip(proposed, counts):
            del request.draft_token_ids[count:]

    def _counts(self, proposed: list[tuple[str, int]], num_running: int) -> list[int]:
        """The drafts each (request id, drafts proposed) verifies: all, or as many as the
        adaptive draft length chooses."""
        if self.lengths is None or not proposed:
            return [num for _, num in proposed]
        return self.lengths.choose(proposed, num_running)

    def _propose_on_device(self, eligible: list[tuple[Request, int, SeqState]],
                           num_running: int) -> None:
        """Dispatch the proposal and leave its drafts on the device: each sequence gets
        placeholders for the drafts it verifies (their count chosen as for drafts on the
        host, with k proposed), and `on_device` where they are."""
        assert self.draft is not None
        tokens, rows = self.draft.dispatch([request for request, _, _ in eligible])
        proposed = [(request, k, row) for (request, k, _), row in zip(eligible, rows)
                    if row is not None]
        if tokens is None or not proposed:
            return
        counts = self._counts([(request.request_id, k) for request, k, _ in proposed],
                              num_running)
        k = self.config.num_speculative_tokens  # each proposed row's drafts in `tokens`
        offsets = {}
        for (request, _, row), count in zip(proposed, counts):
            if count:
                request.draft_token_ids = [0] * count
                offsets[request.request_id] = row * k
        if offsets:
            self.on_device = DeviceDrafts(tokens, offsets)
            self.num_device_proposals += 1

    def _drafts(self, eligible: list[tuple[Request, int, SeqState]]) -> list[list[int]]:
        if self.draft is not None:
            return self.draft.propose([e[0] for e in eligible], [e[1] for e in eligible])
        config = self.config
        return [propose_ngram(request.all_token_ids, k=k, min_n=config.prompt_lookup_min,
                              max_n=config.prompt_lookup_max or config.prompt_lookup_min)
                for request, k, _ in eligible]

    def forget(self, request_id: str) -> None:
        if self.lengths is not None:
            self.lengths.forget(request_id)
        if self.draft is not None:
            self.draft.forget(request_id)

    def verify(self, out: SchedulerOutput, tokens: list[int]
               ) -> dict[int, list[tuple[int, int]]]:
        """The (token, row it was sampled in) each sequence with drafts emits, by its
        row: its kept drafts, then the target's token at the first mismatch (or after
        all its drafts); `tokens`: the step's sampled token per row. Sets
        `self.rejected` (request id -> drafts dropped) for the scheduler."""
        emitted: dict[int, list[tuple[int, int]]] = {}
        self.rejected = {}
        if self.on_device is not None:  # read with the step's tokens
            self.on_device.fill(out)
            self.on_device = None
        if self.lengths is not None and self._began:  # a step that proposed: its time
            self.lengths.observe_step(out.num_batched_tokens, time.perf_counter() - self._began)
            self._began = 0.0  # from its proposals to its tokens
        if not out.num_drafts:  # a step without drafts: nothing to walk
            return emitted
        draft_row = len(out.scheduled)
        for row, scheduled in enumerate(out.scheduled):
            num = scheduled.num_drafts
            if not num:
                continue
            request = scheduled.request
            drafts = request.draft_token_ids[:num]
            kept = 0  # rows draft_row + j sampled the target's token at draft j
            while kept < num and drafts[kept] == tokens[draft_row + kept]:
                kept += 1
            emitted[row] = [(token, draft_row + j) for j, token in enumerate(drafts[:kept])]
            last = draft_row + kept if kept < num else row
            emitted[row].append((tokens[last], last))
            draft_row += num
            self.rejected[request.request_id] = num - kept
            request.draft_token_ids = []
            self._count(request.request_id, num, kept)
        return emitted

    def _count(self, request_id: str, num: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num
        self.num_accepted_tokens += kept
        for position in range(kept):
            self.accepted_per_position[position] += 1
        if self.lengths is not None:
            self.lengths.observe_verify(request_id, num, kept)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 + accepted drafts per step (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


__all__ = ["DeviceDrafts", "Speculator", "grammar_drafts"]
