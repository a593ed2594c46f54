"""Requests, sampling parameters and outputs. Pure Python: no jax, no numpy."""

from __future__ import annotations

import dataclasses
import enum
import numbers
import time

from qwen_jax.validation import require
from serving.core.lora_request import LoRARequest
from serving.core.structured_params import StructuredOutputsParams

# vLLM's _SAMPLING_EPS: temperatures below this are treated as greedy.
SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_token_ids(prompt, tokenizer, vocab_size: int, model_path=None
                     ) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string (encoded by `tokenizer`), a list of
    token ids, or {"prompt_token_ids": [...]} / {"prompt": str}; ids are checked against
    the vocabulary."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt dict needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"model {model_path} has no tokenizer files: pass "
                             "{'prompt_token_ids': [...]} instead of text")
        return prompt, tokenizer.encode(prompt)
    ids = list(prompt)
    for i, t in enumerate(ids):  # numpy's integers are Integral too
        if (not isinstance(t, numbers.Integral) or isinstance(t, bool)
                or not 0 <= int(t) < vocab_size):
            raise ValueError(f"prompt_token_ids[{i}] = {t!r} is not a token id in "
                             f"[0, vocab_size={vocab_size})")
    return None, [int(t) for t in ids]


def _require_range(name: str, value: float, low: float, high: float) -> None:
    require(low <= value <= high, name, value, f"in [{low}, {high}]")


class RequestOutputKind(enum.IntEnum):
    """vLLM's RequestOutputKind: what each RequestOutput of a streamed request holds.

    CUMULATIVE: everything so far (each output copies the token ids: O(length) per step).
    DELTA: what is new since the request's previous output (text held back while it may
    begin a stop string); the prompt's logprobs come once, in the first output.
    FINAL_ONLY: one output, when the request finishes (what `LLM.generate` uses).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _require_logprobs(name: str, value: int | None) -> None:
    if value is None:
        return
    require(_is_int(value), name, value, "an int or None")
    _require_range(name, value, 0, MAX_LOGPROBS)


@dataclasses.dataclass
class SamplingParams:
    """vLLM's sampling parameters, names and defaults included."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # 0: only the sampled token's logprob
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # the grammar the output follows (a dict in vLLM's JSON shape is converted)
    structured_outputs: StructuredOutputsParams | dict | None = None
    # what each output of a streamed request holds (LLM.generate always gets FINAL_ONLY)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.output_kind, str) and self.output_kind in RequestOutputKind.__members__:
            self.output_kind = RequestOutputKind[self.output_kind]
        elif _is_int(self.output_kind) and self.output_kind in iter(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        self._validate()

    def _validate(self) -> None:
        _require_range("n", self.n, 1, MAX_N)
        require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k,
                "-1 (disabled) or >= 0")
        _require_range("min_p", self.min_p, 0.0, 1.0)
        _require_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _require_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
                ">= 1 or None")
        require(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            require(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                    f"<= max_tokens={self.max_tokens}")
        _require_logprobs("logprobs", self.logprobs)
        _require_logprobs("prompt_logprobs", self.prompt_logprobs)
        require(self.seed is None or _is_int(self.seed), "seed", self.seed, "an int or None")
        require(all(isinstance(s, str) and s for s in self.stop or ()), "stop", self.stop,
                "non-empty strings")
        require(self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs", type(self.structured_outputs).__name__,
                "StructuredOutputsParams, a dict or None")
        kinds = ", ".join(RequestOutputKind.__members__)
        require(isinstance(self.output_kind, RequestOutputKind), "output_kind",
                self.output_kind, f"a RequestOutputKind: {kinds}")
        # EOS held back by min_tokens could leave a finished grammar no token to choose
        require(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
                self.min_tokens, "0 with structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


# The one list of sampling field names, and the ones a checkpoint's generation_config.json
# may default (vLLM's `--generation-config auto`) with their neutral values (`vllm` mode;
# top_k -1 as the HTTP API reads it, the same as 0: disabled).
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
GENERATION_CONFIG_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                              "repetition_penalty": 1.0}


def uses_penalties(p: SamplingParams) -> bool:
    """Whether a request applies presence, frequency or repetition penalties."""
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


class RequestStatus(enum.IntEnum):
    """Ordered so that every finished status compares above the live ones."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return FINISH_REASONS.get(status)


# An enum member read off its class goes through the enum's metaclass (~85 ns on CPython
# 3.11); code run per request per step compares with a module constant (~15 ns).
_PREEMPTED = RequestStatus.PREEMPTED

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclasses.dataclass
class RequestMetrics:
    """Monotonic timestamps (seconds) plus the wall-clock arrival for reporting."""

    arrival_time: float
    arrival_wall_time: float = dataclasses.field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence the scheduler tracks. `n > 1` is fanned out by the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0  # lower value is served first, as in vLLM
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = dataclasses.field(default_factory=list)
    # its row in the engine's PageTable (serving/executor/model_inputs.py) while it holds pages
    page_row: int = -1
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Tokens sampled by a dispatched step whose values the host has not read yet (the
    # overlapped loop, serving/engine/llm_engine.py); the scheduler counts them, the rest does not.
    num_pending_tokens: int = 0
    # min(prompt + max_tokens, max_model_len): set by the scheduler when it takes the
    # request (Scheduler.max_num_tokens); 0 until then
    max_num_tokens: int = 0
    stop_reason: int | str | None = None
    # The adapter it runs with (None: the base model), and while running its slot in the
    # model's LoRA buffers (serving/core/lora_slots.py; 0: none)
    lora_request: LoRARequest | None = None
    lora_slot: int = 0
    metrics: RequestMetrics = dataclasses.field(init=False)  # from arrival_time
    # Chained page hashes of full pages, filled lazily by the KV cache manager.
    page_hashes: list[int] = dataclasses.field(default_factory=list, repr=False)
    # Speculative decoding: tokens proposed to follow its last one, checked by the next
    # step (serving/engine/speculation.py); `tokens()` reads them past the known tokens.
    draft_token_ids: list[int] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        require(len(self.prompt_token_ids) > 0, "prompt_token_ids", self.prompt_token_ids,
                f"non-empty (request {self.request_id})")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """num_tokens plus the sampled tokens still on the device: what the scheduler plans."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status > _PREEMPTED  # RequestStatus.is_finished, inlined

    @property
    def finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def token_at(self, index: int) -> int:
        """Token `index` of prompt + output without building the concatenation."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without copying the whole sequence; past them, the
        draft tokens."""
        n = len(self.prompt_token_ids)
        known = n + len(self.output_token_ids)
        if stop > known and self.draft_token_ids:
            return self.tokens(start, known) + self.draft_token_ids[:stop - known]
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    def append_output_token(self, token_id: int, now: float | None = None) -> None:
        """`now`: the monotonic time the token reached the host (default: now)."""
        self.output_token_ids.append(int(token_id))
        if now is None:
            now = time.monotonic()
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    """One generated completion of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """What the engine emits per request per step (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache
    error: str | None = None  # set on the final output of a request the engine failed

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Folds a later output of the same request into this one (vLLM's, for a reader
        that fell behind). `aggregate` (DELTA outputs): each sample's new text, token ids
        and logprobs are appended to its own; otherwise (CUMULATIVE) a sample's later
        output replaces it. A sample this one lacks is added."""
        self.finished = self.finished or next_output.finished
        self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        self.error = next_output.error
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        mine = {c.index: i for i, c in enumerate(self.outputs)}
        for later in next_output.outputs:
            i = mine.get(later.index)
            if i is None:
                mine[later.index] = len(self.outputs)
                self.outputs.append(later)
            elif not aggregate:
                self.outputs[i] = later
            else:
                c = self.outputs[i]
                c.text += later.text
                c.token_ids = c.token_ids + later.token_ids  # never the engine's own list
                if later.logprobs is not None:
                    c.logprobs = (c.logprobs or []) + later.logprobs
                c.cumulative_logprob = later.cumulative_logprob
                c.finish_reason, c.stop_reason = later.finish_reason, later.stop_reason
