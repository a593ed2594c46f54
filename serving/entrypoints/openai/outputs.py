"""Engine outputs -> OpenAI completion / chat responses and SSE chunks for one API call."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import AsyncGenerator
from typing import Any

from serving.core.request import CompletionOutput, RequestOutput, SamplingParams
from serving.entrypoints.openai import protocol as proto
from serving.metrics.prometheus import Metrics
from serving.parsers.chat_reply import ReplyFormat, ReplyStream

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


# One encoder for every chunk: json.dumps with a non-default option builds a JSONEncoder
# per call, a third of the encoding's cost for a small chunk.
_ENCODER = json.JSONEncoder(ensure_ascii=False)


def sse(payload: dict) -> bytes:
    return b"data: " + _ENCODER.encode(payload).encode() + b"\n\n"


# A JSON string as _ENCODER writes one (quoted, escaped, non-ASCII kept): chunk templates
# put text in with it.
_encode_string = json.encoder.encode_basestring  # type: ignore[attr-defined]
_TEXT_SLOT = "qwen-jax-chunk-text-slot"


async def merge(gens: list) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, output) from several AsyncLLM streams as they arrive. Closing or
    cancelling the merged stream closes every input stream, which aborts its request."""
    if len(gens) == 1:
        try:
            async for output in gens[0]:
                yield 0, output
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen) -> None:
        try:
            async for output in gen:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


def _ranked(entry: dict, k: int) -> list:
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                  key=lambda lp: lp.rank)[:k]


def completion_logprobs(token_ids: list[int], entries: list[dict], k: int,
                        text_offset: int = 0) -> dict:
    """OpenAI completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        top = {lp.decoded_token or "": _clamp(lp.logprob) for lp in _ranked(entry, k)}
        top.setdefault(token, _clamp(sampled.logprob))
        out["tokens"].append(token)
        out["token_logprobs"].append(_clamp(sampled.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                 "decoded_token": lp.decoded_token} for t, lp in entry.items()}
        for entry in entries]


@dataclasses.dataclass(frozen=True)
class Echo:
    """completions' `echo`: each prompt's text, prepended to its choices, and its first
    token's text (the one token without a logprob)."""

    texts: list[str]
    first_tokens: list[str]
    hide_output: bool = False  # max_tokens 0: the prompt alone (the token made is unshown)

    def logprobs(self, p: int, prompt_ids: list[int], entries: list | None, k: int) -> dict:
        """completions logprobs over prompt p: its first token's null, offsets from 0."""
        first = self.first_tokens[p]
        rest = completion_logprobs(prompt_ids[1:], (entries or [None])[1:], k, len(first))
        return {"tokens": [first, *rest["tokens"]],
                "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]],
                "text_offset": [0, *rest["text_offset"]]}


def make_echo(req: proto.ParsedRequest, prompts: list, ids: list[list[int]],
              tokenizer) -> Echo | None:
    """The Echo of a completions request with echo=true (prompts as given: text, or ids
    decoded), else None."""
    if not req.echo:
        return None
    decode = (lambda t: "") if tokenizer is None else (
        lambda t: tokenizer.decode(t, skip_special_tokens=False))
    return Echo([p if isinstance(p, str) else decode(i) for p, i in zip(prompts, ids)],
                [decode(i[:1]) for i in ids], req.echo_only)


def _chat_token(lp) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": _clamp(lp.logprob), "bytes": list(token.encode())}


def chat_logprobs(token_ids: list[int], entries: list[dict], k: int) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [{**_chat_token(entry[t]),
                         "top_logprobs": [_chat_token(lp) for lp in _ranked(entry, k)]}
                        for t, entry in zip(token_ids, entries)]}


@dataclasses.dataclass(eq=False)
class Choice:
    """One choice of a call: its DELTA outputs added up."""

    index: int  # its sample's index among its prompt's n
    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_chars: int = 0
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        self.token_ids += c.token_ids
        if c.text:
            self.texts.append(c.text)
            self.num_chars += len(c.text)
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += c.logprobs
        self.cumulative_logprob = c.cumulative_logprob
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, "".join(self.texts), self.token_ids,
                                self.cumulative_logprob, self.logprobs, self.finish_reason,
                                self.stop_reason)


@dataclasses.dataclass(eq=False)
class Job:
    """One /v1/completions or /v1/chat/completions call: its prompts, each choice's outputs
    added up (the engine streams DELTA outputs: what is new since the one before), and
    each chat choice's reply parser."""

    kind: str  # "cmpl", "chatcmpl" or "resp"
    request_id: str
    model: str
    req: proto.ParsedRequest
    prompts: list[list[int]]
    params: list[SamplingParams]
    metrics: Metrics
    reply: ReplyFormat = ReplyFormat()  # chat only: reasoning and tool-call parsing
    echo: Echo | None = None  # completions with echo=true

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.n = self.req.sampling["n"]
        self.latest: list[RequestOutput | None] = [None] * len(self.prompts)
        self.trackers = [self.metrics.tracker(p) for p in self.params]
        self.choices: dict[int, Choice] = {}
        self.streams: dict[int, ReplyStream] = {}
        self._templates: dict[int, tuple[bytes, bytes] | None] = {}  # see _template
        self.prompt_logprobs: list = [None] * len(self.prompts)  # each prompt's, once out
        self._started: set[int] = set()  # choices with a chunk sent (echo: the prompt's)

    @property
    def chat(self) -> bool:
        return self.kind in ("chatcmpl", "resp")  # resp: the Responses API's (responses.py)

    def add(self, p: int, output: RequestOutput) -> list[tuple[int, CompletionOutput, int]]:
        """Adds prompt p's DELTA output to its choices. Returns each part as (choice index,
        the part, the number of characters of the choice before it)."""
        self.trackers[p].observe(output)
        self.latest[p] = output
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[p] = output.prompt_logprobs
        parts = []
        for c in output.outputs:
            index = p * self.n + c.index
            choice = self.choices.get(index)
            if choice is None:
                choice = self.choices[index] = Choice(c.index)
            parts.append((index, c, choice.num_chars))
            choice.add(c)
        return parts

    # ---- whole responses ---------------------------------------------------------------
    def usage(self) -> dict:
        hidden = self.echo is not None and self.echo.hide_output
        usage = proto.usage(sum(map(len, self.prompts)), 0 if hidden else
                            sum(len(c.token_ids) for c in self.choices.values()))
        cached = sum(o.num_cached_tokens or 0 for o in self.latest if o is not None)
        return {**usage, "prompt_tokens_details": {"cached_tokens": cached}}

    def response(self) -> dict:
        choices = []
        for i in sorted(self.choices):
            c = self.choices[i].completion()
            choices.append(self._choice(i, c, c.text, c.finish_reason))
        out: dict[str, Any] = {"id": self.request_id,
               "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices,
               "usage": self.usage()}
        if self.chat and self.req.prompt_logprobs is not None:  # vLLM's: top level in chat
            out["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs[0])
        return out

    def log_fields(self) -> dict:
        reasons = sorted({str(c.finish_reason) for c in self.choices.values()})
        return {"completion_tokens": self.usage()["completion_tokens"],
                "finish": ",".join(reasons)}

    def _logprobs(self, c: CompletionOutput, text_offset: int):
        if self.req.logprobs is None or c.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(c.token_ids, c.logprobs, self.req.logprobs)
        return completion_logprobs(c.token_ids, c.logprobs, self.req.logprobs, text_offset)

    def _choice(self, index: int, c: CompletionOutput, text: str, finish_reason: str | None,
                *, delta: dict | None = None, text_offset: int = 0, first: bool = True) -> dict:
        choice: dict[str, Any] = {"index": index}
        if delta is not None:
            choice["delta"] = delta
        elif self.chat:
            choice["message"], finish_reason = self.reply.message(text, finish_reason)
        elif self.echo is not None or self.req.prompt_logprobs is not None:
            return self._echoed(index, c, text, finish_reason, text_offset, first)
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(c, text_offset)
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = c.stop_reason if finish_reason else None
        return choice

    def _echoed(self, index: int, c: CompletionOutput, text: str, finish_reason: str | None,
                text_offset: int, first: bool) -> dict:
        """A completions choice with echo or prompt_logprobs: with echo, the prompt's text
        (and logprobs) first, in a whole response or a stream's first chunk, and the
        generated part after it unless hidden (max_tokens 0); vLLM's prompt_logprobs in
        the first."""
        echo, p = self.echo, index // self.n
        prompt = echo.texts[p] if echo is not None and first else ""
        shown = echo is None or not echo.hide_output
        logprobs: dict[str, list] | None = None
        if self.req.logprobs is not None:
            merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                       "text_offset": []}
            parts = [echo.logprobs(p, self.prompts[p], self.prompt_logprobs[p],
                                   self.req.logprobs)] if echo is not None and first else []
            if shown and c.logprobs is not None:
                parts.append(completion_logprobs(c.token_ids, c.logprobs, self.req.logprobs,
                                                 len(echo.texts[p] if echo else "")
                                                 + text_offset))
            for part in parts:
                for key in merged:
                    merged[key] += part[key]
            logprobs = merged
        choice: dict[str, Any] = {"index": index, "text": prompt + (text if shown else ""),
                  "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": c.stop_reason if finish_reason else None}
        if self.req.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs[p])
        return choice

    # ---- streaming ---------------------------------------------------------------------
    def _chunk(self, choices: list[dict]) -> dict:
        chunk: dict[str, Any] = {"id": self.request_id,
                                 "object": "chat.completion.chunk" if self.chat
                                 else "text_completion",
                                 "created": self.created, "model": self.model,
                                 "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def sse_chunks(self, p: int, output: RequestOutput) -> list[bytes]:
        """SSE events for what `output` (DELTA) adds to prompt p's choices. A chunk that
        holds only text (no role, reasoning, tool calls, logprobs or finish: nearly every
        chunk of a stream) is its choice's template with the text put in: building and
        encoding the whole chunk cost 2.5-4x as much (measured: git commit 53afd37)."""
        out = []
        plain = self.req.logprobs is None  # no logprobs asked: every chunk's are null
        for index, c, num_chars in self.add(p, output):
            finish = c.finish_reason
            if self.chat:
                delta = self._delta(index, c.text, index not in self.streams, finish is not None)
                finish = self.streams[index].finish_reason(finish)
                if plain and finish is None and len(delta) == 1 and "content" in delta:
                    template = self._template(index)
                    if template is not None:
                        out.append(template[0] + _encode_string(delta["content"]).encode()
                                   + template[1])
                        continue
                out.append(sse(self._chunk([self._choice(index, c, c.text, finish,
                                                         delta=delta)])))
            elif self.echo is not None or self.req.prompt_logprobs is not None:
                first = index not in self._started
                self._started.add(index)
                if first or finish is not None or not (self.echo and self.echo.hide_output):
                    out.append(sse(self._chunk([self._choice(
                        index, c, c.text, finish, text_offset=num_chars, first=first)])))
            elif plain and finish is None and (template := self._template(index)) is not None:
                out.append(template[0] + _encode_string(c.text).encode() + template[1])
            else:
                out.append(sse(self._chunk([self._choice(index, c, c.text, finish,
                                                         text_offset=num_chars)])))
        return out

    def deltas(self, p: int, output: RequestOutput) -> list[tuple[int, dict, str | None]]:
        """What `output` (DELTA) adds to prompt p's chat choices, as (choice index, delta,
        finish_reason): the Responses API's stream (responses.py) reads these."""
        out = []
        for index, c, _ in self.add(p, output):
            delta = self._delta(index, c.text, index not in self.streams,
                                c.finish_reason is not None)
            out.append((index, delta, self.streams[index].finish_reason(c.finish_reason)))
        return out

    def _template(self, index: int) -> tuple[bytes, bytes] | None:
        """The SSE event of a text-only chunk of choice `index`, cut where its text goes
        (None if the id or model name holds the marker: such chunks are encoded whole)."""
        templates = self._templates
        if index not in templates:
            slot = CompletionOutput(index, _TEXT_SLOT, [])
            choice = (self._choice(index, slot, _TEXT_SLOT, None, delta={"content": _TEXT_SLOT})
                      if self.chat else self._choice(index, slot, _TEXT_SLOT, None))
            parts = sse(self._chunk([choice])).split(_encode_string(_TEXT_SLOT).encode())
            templates[index] = (parts[0], parts[1]) if len(parts) == 2 else None
        return templates[index]

    def _delta(self, index: int, text: str, first: bool, finished: bool) -> dict:
        stream = self.streams.get(index)
        if stream is None:  # not setdefault: that builds a stream for every chunk
            stream = self.streams[index] = self.reply.stream()
        return {**({"role": "assistant"} if first else {}), **stream.delta(text, finished)}

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": self.usage()}
