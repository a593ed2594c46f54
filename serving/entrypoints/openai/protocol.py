"""OpenAI / vLLM request parsing and response building for the HTTP server. No aiohttp here.

Parsing checks every known field's type and range and raises `APIError` (400) naming the
field and its limit. Unknown top-level fields are accepted and ignored (the caller logs
them), as OpenAI does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from serving.core.lora_request import LoRARequest
from serving.core.request import (
    GENERATION_CONFIG_DEFAULTS,
    MAX_LOGPROBS,
    MAX_N,
    SAMPLING_FIELDS,
    RequestOutputKind,
    SamplingParams,
)
from serving.core.structured_params import StructuredOutputsParams
from serving.entrypoints.openai.errors import bad
from serving.entrypoints.openai.structured_requests import (
    STRUCTURED_FIELDS,
    TOOL_FIELDS,
    UNSUPPORTED_FIELDS,
    ToolRequest,
    read_structured,
    read_tools,
    reject_unsupported,
)

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_BATCH_PROMPTS = 64
# The SamplingParams fields a body sets under their own names (logprobs, prompt_logprobs
# and structured outputs are read apart; output_kind follows `stream`).
_SAMPLING_FIELDS = set(SAMPLING_FIELDS) - {"logprobs", "prompt_logprobs", "structured_outputs",
                                           "output_kind"}
_COMMON_FIELDS = _SAMPLING_FIELDS | STRUCTURED_FIELDS | UNSUPPORTED_FIELDS | {
    "model", "stream", "stream_options", "priority", "user", "logprobs", "best_of",
    "logit_bias", "metadata", "store", "service_tier", "prompt_logprobs"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _COMMON_FIELDS | TOOL_FIELDS | {
    "messages", "top_logprobs", "max_completion_tokens", "chat_template_kwargs",
    "add_generation_prompt", "response_format", "include_reasoning"}



def describe(value: Any) -> str:
    """A short rendering of a client value for error messages (never the whole body)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: bytes) -> dict:
    """Request body bytes -> a JSON object, or APIError(400)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad("body", f"request body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad("body", "request body is nested too deeply") from None
    except ValueError as exc:
        raise bad("body", f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("body", f"request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- field readers ---------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_int(body: dict, name: str, default, low: int, high: int):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad(name, f"{name} must be an integer, got {describe(value)}")
    if not low <= value <= high:
        raise bad(name, f"{name} must be in [{low}, {high}], got {value}")
    return value


def read_float(body: dict, name: str, default, low: float, high: float, *,
               low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if not (_is_int(value) or (isinstance(value, float) and math.isfinite(value))):
        raise bad(name, f"{name} must be a number, got {describe(value)}")
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise bad(name, f"{name} must be in {bracket}{low}, {high}], got {describe(value)}")
    return float(value)


def read_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be a boolean, got {describe(value)}")
    return value


def read_str(body: dict, name: str, default: str | None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(name, f"{name} must be a string, got {describe(value)}")
    return value


def read_dict(body: dict, name: str) -> dict:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(name, f"{name} must be an object, got {describe(value)}")
    return value


def _read_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"stop must be a non-empty string or a list of them, got "
                          f"{describe(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}")
    return stops


def read_token_ids(value: Any, name: str, vocab_size: int, max_len: int) -> list[int]:
    if not isinstance(value, list):
        raise bad(name, f"{name} must be a list of token ids, got {describe(value)}")
    if len(value) > max_len:
        raise bad(name, f"{name} has {len(value)} ids; at most {max_len}")
    for i, t in enumerate(value):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise bad(name, f"{name}[{i}] = {describe(t)} is not a token id in "
                            f"[0, {vocab_size})")
    return value


@dataclasses.dataclass
class ParsedRequest:
    """What a route needs after validation; `sampling` lacks max_tokens until the prompt
    length is known (see `sampling_params`)."""

    model: str | None
    stream: bool
    include_usage: bool
    priority: int
    sampling: dict
    max_tokens: int | None  # None: fill the context (chat) or the completions default
    default_max_tokens: int | None
    logprobs: int | None  # top-k logprobs per token; None: off
    prompt_logprobs: int | None = None  # vLLM's: top-k per prompt token; None: off
    echo: bool = False  # completions: the prompt before each choice's text
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (scoring)
    prompts: list = dataclasses.field(default_factory=list)  # completions: str | list[int]
    messages: list | None = None
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    tools: list | None = None  # passed to the chat template
    tool_request: ToolRequest | None = None  # chat: tools, tool_choice, parallel_tool_calls
    structured: StructuredOutputsParams | None = None
    structured_field: str = ""  # the request field the constraint came from
    include_reasoning: bool = True
    unknown_fields: list[str] = dataclasses.field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter `model` names (the server's)


def _read_sampling(body: dict, vocab_size: int, defaults: dict) -> dict:
    """`defaults`: GENERATION_CONFIG_DEFAULTS overridden by the model's generation config."""
    top_k = read_int(body, "top_k", defaults["top_k"], -1, INT32_MAX)
    return dict(
        n=read_int(body, "n", 1, 1, MAX_N),
        temperature=read_float(body, "temperature", defaults["temperature"], 0.0,
                               MAX_TEMPERATURE),
        top_p=read_float(body, "top_p", defaults["top_p"], 0.0, 1.0, low_open=True),
        top_k=0 if top_k >= vocab_size else top_k,  # a top_k past the vocab keeps everything
        min_p=read_float(body, "min_p", defaults["min_p"], 0.0, 1.0),
        presence_penalty=read_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=read_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=read_float(body, "repetition_penalty",
                                      defaults["repetition_penalty"], 0.0,
                                      MAX_REPETITION_PENALTY, low_open=True),
        seed=read_int(body, "seed", None, INT64_MIN, INT64_MAX),
        stop=_read_stop(body),
        stop_token_ids=read_token_ids(body.get("stop_token_ids") or [], "stop_token_ids",
                                      vocab_size, MAX_STOP_TOKEN_IDS),
        ignore_eos=read_bool(body, "ignore_eos", False),
        min_tokens=read_int(body, "min_tokens", 0, 0, INT32_MAX),
        skip_special_tokens=read_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=read_bool(body, "include_stop_str_in_output", False))


def _reject_unsupported(body: dict, n: int) -> None:
    if body.get("suffix") is not None:
        raise bad("suffix", "suffix is not supported")
    if body.get("logit_bias"):
        raise bad("logit_bias", "logit_bias is not supported")
    best_of = read_int(body, "best_of", n, 1, MAX_N)
    if best_of != n:
        raise bad("best_of", f"best_of must equal n={n} (beam search is not supported), "
                             f"got {best_of}")


def _read_common(body: dict, known: set[str], vocab_size: int,
                 defaults: dict | None) -> ParsedRequest:
    chat = "messages" in known
    reject_unsupported(body, chat)
    sampling = _read_sampling(body, vocab_size, {**GENERATION_CONFIG_DEFAULTS, **(defaults or {})})
    _reject_unsupported(body, sampling["n"])
    structured, field = read_structured(body, chat)
    stream = read_bool(body, "stream", False)
    options = read_dict(body, "stream_options")
    if body.get("stream_options") is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed when stream=true")
    return ParsedRequest(
        model=read_str(body, "model", None), stream=stream,
        include_usage=read_bool(options, "include_usage", False),
        priority=read_int(body, "priority", 0, -INT32_MAX - 1, INT32_MAX),
        sampling=sampling, max_tokens=None, default_max_tokens=None, logprobs=None,
        prompt_logprobs=read_int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS),
        structured=structured, structured_field=field,
        unknown_fields=sorted(k for k in body if k not in known))


def parse_completion(body: dict, vocab_size: int, defaults: dict | None = None) -> ParsedRequest:
    """`defaults`: sampling defaults from the model's generation config."""
    req = _read_common(body, COMPLETION_FIELDS, vocab_size, defaults)
    read_str(body, "user", None)
    req.echo = read_bool(body, "echo", False)
    # max_tokens 0 only with echo: the prompt's logprobs alone (one token is generated
    # and not shown, as the engine makes at least one)
    req.max_tokens = read_int(body, "max_tokens", None, 0 if req.echo else 1, INT32_MAX)
    req.echo_only = req.max_tokens == 0
    if req.echo_only:
        req.max_tokens = 1
    req.default_max_tokens = 16  # OpenAI's completions default
    req.logprobs = read_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if req.echo and req.logprobs is not None:  # the prompt's tokens get logprobs too
        req.prompt_logprobs = max(req.prompt_logprobs or 0, req.logprobs)
    req.prompts = _read_prompts(body.get("prompt"), vocab_size)
    return req


def _read_prompts(prompt: Any, vocab_size: int) -> list:
    """str | list[int] | list[str] | list[list[int]] -> a list of prompts (a batch)."""
    if prompt is None:
        raise bad("prompt", "prompt is required")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", f"prompt must be a string, a list of token ids, or a non-empty "
                            f"list of either, got {describe(prompt)}")
    if all(_is_int(t) for t in prompt):
        return [read_token_ids(prompt, "prompt", vocab_size, 10**7)]
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise bad("prompt", f"prompt batch has {len(prompt)} prompts; at most "
                            f"{MAX_BATCH_PROMPTS}")
    batch: list[str | list[int]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            batch.append(p)
        elif isinstance(p, list) and p:
            batch.append(read_token_ids(p, f"prompt[{i}]", vocab_size, 10**7))
        else:
            raise bad("prompt", f"prompt[{i}] must be a string or a non-empty list of token "
                                f"ids, got {describe(p)}")
    return batch


def parse_chat(body: dict, vocab_size: int, defaults: dict | None = None) -> ParsedRequest:
    req = _read_common(body, CHAT_FIELDS, vocab_size, defaults)
    read_str(body, "user", None)
    max_tokens = read_int(body, "max_completion_tokens", None, 1, INT32_MAX)
    req.max_tokens = read_int(body, "max_tokens", max_tokens, 1, INT32_MAX)
    if read_bool(body, "logprobs", False):
        req.logprobs = read_int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        read_int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
        raise bad("top_logprobs", "top_logprobs requires logprobs=true")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages must be a non-empty list, got {describe(messages)}")
    req.messages = messages
    req.template_kwargs = dict(read_dict(body, "chat_template_kwargs"))
    for reserved in ("messages", "tools", "add_generation_prompt", "tokenize"):
        if reserved in req.template_kwargs:
            raise bad("chat_template_kwargs", f"chat_template_kwargs may not set {reserved!r}")
    req.template_kwargs["add_generation_prompt"] = read_bool(body, "add_generation_prompt", True)
    req.tool_request = read_tools(body)
    req.tools = req.tool_request.tools or None
    if req.tool_request.constrained and req.structured is not None:
        raise bad("tool_choice", f"tool_choice {req.tool_request.choice!r} constrains the reply "
                                 f"itself; it cannot be combined with {req.structured_field}")
    req.include_reasoning = read_bool(body, "include_reasoning", True)
    return req


def sampling_params(req: ParsedRequest, num_prompt_tokens: int, max_model_len: int,
                    prompt_param: str) -> SamplingParams:
    """The request's SamplingParams once its prompt length is known (context checks)."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad(prompt_param, f"the prompt has {num_prompt_tokens} tokens; max_model_len="
                                f"{max_model_len} allows at most {max_model_len - 1} "
                                "(at least one token must be generated)")
    if req.max_tokens is not None and req.max_tokens > room:
        raise bad("max_tokens", f"max_tokens={req.max_tokens} plus the prompt's "
                                f"{num_prompt_tokens} tokens exceeds max_model_len="
                                f"{max_model_len}; at most {room}")
    max_tokens = req.max_tokens or min(req.default_max_tokens or room, room)
    try:
        # A stream gets DELTA outputs (each holds what is new, see Job: a streamed output's
        # cost does not grow with its length); a whole response only its final one.
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(**req.sampling, max_tokens=max_tokens, logprobs=req.logprobs,
                              prompt_logprobs=req.prompt_logprobs,
                              structured_outputs=req.structured, output_kind=kind)
    except ValueError as exc:
        raise bad(str(exc).split()[0], str(exc)) from None


# ---- responses -------------------------------------------------------------------------
def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
