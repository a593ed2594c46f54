"""Per-sequence post-processing of sampled tokens: detokenization, stop conditions,
logprobs, and gathering the n samples of a request into one RequestOutput."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from serving.core.request import (
    FINISH_REASONS,
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    uses_penalties,
)
from serving.engine.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # host-side code: the sampler's types only, not jax
    from serving.sample.sampling_arrays import SamplingEntry, TokenLogprobs
    from serving.structured_output.grammar import Guide


@dataclasses.dataclass
class Logprob:
    """vLLM's Logprob: one candidate token of one position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class SeqState:
    """Host-side state of one sampled sequence (one of a request's n)."""

    request: Request
    parent_id: str
    index: int
    seed: int
    blocked_ids: tuple[int, ...]  # eos/stop ids suppressed until min_tokens
    detokenizer: IncrementalDetokenizer | None
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    guide: Guide | None = None  # the grammar guide of a constrained sequence
    uses_penalties: bool = False  # its sampling params penalise repeats (set on creation)
    sampling_entry: SamplingEntry | None = None  # its sampling arrays' row, kept by the engine
    # How many of its tokens earlier outputs held (stream_interval); DELTA outputs: and
    # whether one carried its finish reason (the detokenizer keeps what text was taken;
    # logprobs entries are handed over and dropped as sent)
    num_sent_tokens: int = 0
    sent_final: bool = False

    def __post_init__(self) -> None:
        self.uses_penalties = uses_penalties(self.request.sampling_params)

    @property
    def params(self):
        return self.request.sampling_params

    @property
    def text(self) -> str:
        """Its output text so far (joined when read: CUMULATIVE and final outputs)."""
        detokenizer = self.detokenizer
        return "" if detokenizer is None else detokenizer.text


@dataclasses.dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[SeqState]
    stream: bool = True  # False: only the final output is built (offline generate)
    prompt_logprobs: list | None = None  # DELTA outputs hand it over once, in the first
    num_prompt_logprobs: int = 0  # the most likely tokens each prompt entry holds
    prompt_scored: int = 0  # prompt positions scored so far (engine/prompt_scoring.py)
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    delta: bool = False  # its outputs hold what is new since the one before (DELTA)

    @property
    def finished(self) -> bool:
        children = self.children
        if len(children) == 1:
            return children[0].request.is_finished
        return all(c.request.is_finished for c in children)


class OutputProcessor:
    # What outputs are built with, from RequestOutput's and CompletionOutput's fields in
    # order. The engine process builds its wire tuples with them instead of objects it
    # would only take apart again (serving/engine/process.py).
    make_output: Callable[..., Any] = RequestOutput
    make_completion: Callable[..., Any] = CompletionOutput

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def blocked_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids a request's draws mask until its min_tokens: eos (unless ignored) and
        its stop ids; () without min_tokens."""
        if params.min_tokens == 0:
            return ()
        from serving.sample.sampling_arrays import NUM_BLOCKED  # (a jax module: when used)
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        stop_ids = tuple(params.stop_token_ids or ())
        blocked = tuple(dict.fromkeys(eos + stop_ids))
        if len(blocked) > NUM_BLOCKED:
            raise ValueError(f"stop_token_ids has {len(stop_ids)} ids; with "
                             f"min_tokens > 0 at most {NUM_BLOCKED - len(eos)} are supported")
        return blocked

    def new_seq(self, request: Request, parent_id: str, index: int, seed: int,
                blocked_ids: tuple[int, ...]) -> SeqState:
        """The host-side state of sample `index` of a request: its detokenizer (with the
        request's stop strings) where there is a tokenizer, its logprobs when asked."""
        params = request.sampling_params
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens, stop=list(params.stop or ()),
                include_stop_str_in_output=params.include_stop_str_in_output)
        return SeqState(request=request, parent_id=parent_id, index=index, seed=seed,
                        blocked_ids=blocked_ids, detokenizer=detokenizer,
                        logprobs=[] if params.logprobs is not None else None)

    def append(self, seq: SeqState, token: int, logprobs: TokenLogprobs | None, row: int,
               now: float | None = None) -> RequestStatus | None:
        """Record `token`, sampled for `row` of a step whose logprobs are `logprobs` and
        read at monotonic time `now`; return a finished status if the sequence stops (its
        request's length cap is `max_num_tokens`, set when the scheduler took it).
        Runs once per sampled token of every request: one call, no helpers on the way."""
        request = seq.request
        params = request.sampling_params
        request.append_output_token(token, now)
        if seq.logprobs is not None:
            self._record_logprobs(seq, token, logprobs, row)
        status = None
        detokenizer = seq.detokenizer
        if detokenizer is not None:
            detokenizer.append(token)
            if detokenizer.stop_reason is not None:  # a stop string ended the text
                request.stop_reason = detokenizer.stop_reason
                status = RequestStatus.FINISHED_STOPPED
        num_output = len(request.output_token_ids)
        if status is None and num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                status = RequestStatus.FINISHED_STOPPED
        if status is None and num_output + len(request.prompt_token_ids) >= request.max_num_tokens:
            status = RequestStatus.FINISHED_LENGTH_CAPPED
        if status is not None:
            self.flush(seq)
        return status

    @staticmethod
    def flush(seq: SeqState) -> None:
        """Release text held back for a possible stop string once the sequence ends."""
        if seq.detokenizer is not None:
            seq.detokenizer.finish()  # a DELTA output takes the released text

    def _record_logprobs(self, seq: SeqState, token: int, logprobs: TokenLogprobs | None,
                         row: int) -> None:
        num = seq.params.logprobs
        if num is None or seq.logprobs is None:  # both set iff logprobs were asked
            return
        if logprobs is None:
            raise ValueError(f"request {seq.request.request_id!r} asked for logprobs but "
                             "the step computed none")
        seq.cumulative_logprob += float(logprobs.logprob[row])
        seq.logprobs.append(self.logprob_entry(token, logprobs, row, num))

    def logprob_entry(self, token: int, logprobs: TokenLogprobs, row: int,
                       num: int) -> dict[int, Logprob]:
        """{token_id: Logprob} of one position: the chosen token, then the `num` most likely
        (the chosen one keeps its own entry when it is among them)."""
        entry = {token: Logprob(float(logprobs.logprob[row]), int(logprobs.rank[row]),
                                self._decode_one(token))}
        top = zip(logprobs.top_ids[row][:num], logprobs.top_logprobs[row][:num])
        for rank, (tid, lp) in enumerate(top, start=1):
            entry.setdefault(int(tid), Logprob(float(lp), rank, self._decode_one(int(tid))))
        return entry

    def _decode_one(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def completion(self, seq: SeqState) -> CompletionOutput:
        request = seq.request  # positional construction: this runs per request per step
        seq.num_sent_tokens = len(request.output_token_ids)
        logprobs = seq.logprobs  # copied as the token ids are: later steps append to them
        return self.make_completion(
            seq.index, seq.text, request.output_token_ids.copy(),
            None if logprobs is None else seq.cumulative_logprob,
            None if logprobs is None else logprobs.copy(),
            FINISH_REASONS.get(request.status), request.stop_reason)

    def streamed_output(self, parent: ParentState, seq: SeqState) -> RequestOutput:
        """request_output(parent, False) of a request with one sample that goes on: built
        in one call, as it is per streamed request per step."""
        request = seq.request
        seq.num_sent_tokens = len(request.output_token_ids)
        logprobs = seq.logprobs
        return self.make_output(
            parent.request_id, parent.prompt, parent.prompt_token_ids, parent.prompt_logprobs,
            [self.make_completion(seq.index, seq.text, request.output_token_ids.copy(),
                                  None if logprobs is None else seq.cumulative_logprob,
                                  None if logprobs is None else logprobs.copy(), None,
                                  request.stop_reason)],
            False, request.metrics, request.num_cached_tokens, parent.error)

    def delta_completion(self, seq: SeqState) -> CompletionOutput | None:
        """What `seq` adds to its previous DELTA output: its new token ids and their
        logprobs, its new text (the detokenizer's delta: held back while it may begin a
        stop string) and, once, its finish reason; None when it has nothing new. Costs
        what is new, not the sequence's length."""
        request = seq.request
        tokens = request.output_token_ids
        start = seq.num_sent_tokens
        finish = FINISH_REASONS.get(request.status)
        detokenizer = seq.detokenizer
        text = "" if detokenizer is None else detokenizer.take_delta(final=finish is not None)
        if start == len(tokens) and not text and (finish is None or seq.sent_final):
            return None
        seq.num_sent_tokens = len(tokens)
        seq.sent_final = finish is not None
        logprobs = seq.logprobs
        if logprobs is not None:
            seq.logprobs = []  # the engine keeps no entry a DELTA output has handed over
        return self.make_completion(
            seq.index, text, tokens[start:],
            None if logprobs is None else seq.cumulative_logprob, logprobs, finish,
            request.stop_reason)

    def streamed_delta(self, parent: ParentState, seq: SeqState) -> RequestOutput:
        """streamed_output's DELTA counterpart: the output of a request with one sample
        that goes on (its prompt logprobs, if any, in the first)."""
        request = seq.request
        completion = self.delta_completion(seq)  # never None: it has a new token
        prompt_logprobs, parent.prompt_logprobs = parent.prompt_logprobs, None
        return self.make_output(
            parent.request_id, parent.prompt, parent.prompt_token_ids, prompt_logprobs,
            [] if completion is None else [completion], False, request.metrics,
            request.num_cached_tokens, parent.error)

    def request_output(self, parent: ParentState, finished: bool | None = None) -> RequestOutput:
        """`finished`: parent.finished, where the caller has it. A DELTA request's output
        holds the samples with something new, each with only what is new."""
        children = parent.children
        first = children[0].request
        prompt_logprobs = parent.prompt_logprobs
        if parent.delta:
            completions = [c for c in map(self.delta_completion, children) if c is not None]
            parent.prompt_logprobs = None
        else:
            completions = list(map(self.completion, children))
        return self.make_output(
            parent.request_id, parent.prompt, parent.prompt_token_ids, prompt_logprobs,
            completions, parent.finished if finished is None else finished, first.metrics,
            first.num_cached_tokens, parent.error)


def stream_due(seq: SeqState, interval: int) -> bool:
    """Whether a streamed sequence that goes on gets an output this step under
    `stream_interval`: at its first token, then once `interval` tokens are new."""
    sent = seq.num_sent_tokens
    return not sent or len(seq.request.output_token_ids) - sent >= interval
