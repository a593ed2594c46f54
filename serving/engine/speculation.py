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

Lossless by construction for what it speculates: only greedy sequences (temperature 0)
without penalties, a grammar, logprobs or a pending min_tokens get drafts, so each
verifying row's argmax (the sampler's greedy path) is exactly the token the plain
engine would emit. Other sequences decode as
before in the same batch. The engine steps serially while speculation is on: the next
step's input depends on how many drafts were kept.
"""

from __future__ import annotations

from serving.core.request import Request, SamplingParams, uses_penalties
from serving.core.scheduler_output import SchedulerOutput
from serving.core.speculative import SpeculativeConfig, propose_ngram
from serving.engine.output_processor import SeqState


def speculates(seq: SeqState) -> bool:
    """Whether this sequence gets drafts: its tokens are its rows' argmax."""
    params: SamplingParams = seq.params
    return (params.greedy and seq.guide is None and not uses_penalties(params)
            and params.logprobs is None
            and (not seq.blocked_ids
                 or len(seq.request.output_token_ids) >= params.min_tokens))


class Speculator:
    """Proposes drafts and verifies them; counts what vLLM's spec-decode metrics count."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        k = config.num_speculative_tokens
        self.num_drafts = 0           # verify steps of a sequence with drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k
        self.rejected: dict[str, int] = {}  # the last verified step's, by request id

    def propose(self, running: list[Request], seqs: dict[str, SeqState]) -> None:
        """Sets each running decoding sequence's draft tokens (none for the others)."""
        config = self.config
        for request in running:
            request.draft_token_ids = []
            seq = seqs.get(request.request_id)
            num_tokens = request.num_tokens
            if (seq is None or request.num_computed_tokens != num_tokens - 1
                    or request.num_pending_tokens or not speculates(seq)):
                continue
            # room for the drafts and the token after them within max_tokens / the model
            room = (request.max_num_tokens or num_tokens + 1) - num_tokens - 1
            k = min(config.num_speculative_tokens, room)
            if k > 0:
                request.draft_token_ids = propose_ngram(
                    request.all_token_ids, k=k, min_n=config.prompt_lookup_min,
                    max_n=config.prompt_lookup_max or config.prompt_lookup_min)

    def verify(self, out: SchedulerOutput, tokens: list[int]) -> dict[int, list[int]]:
        """The tokens each row with drafts emits (its kept drafts, then the target's
        token), by row; `tokens`: the step's sampled token per row. Sets
        `self.rejected` (request id -> drafts dropped) for the scheduler."""
        emitted: dict[int, list[int]] = {}
        self.rejected = {}
        if not out.num_drafts:  # a step without drafts: nothing to walk
            return emitted
        draft_row = len(out.scheduled)
        for row, scheduled in enumerate(out.scheduled):
            num = scheduled.num_drafts
            if not num:
                continue
            request = scheduled.request
            drafts = request.draft_token_ids[:num]
            targets = tokens[draft_row:draft_row + num]  # the target's token at each draft
            draft_row += num
            kept = 0
            while kept < num and drafts[kept] == targets[kept]:
                kept += 1
            emitted[row] = drafts[:kept] + [targets[kept] if kept < num else tokens[row]]
            self.rejected[request.request_id] = num - kept
            request.draft_token_ids = []
            self.num_drafts += 1
            self.num_draft_tokens += num
            self.num_accepted_tokens += kept
            for position in range(kept):
                self.accepted_per_position[position] += 1
        return emitted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 + accepted drafts per step (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


__all__ = ["Speculator", "speculates"]
