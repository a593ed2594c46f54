"""Tool-call parsers (vLLM's `--tool-call-parser`): pull a model's tool calls out of its
reply. Host-side text only: no jax, no tokenizer. One parser object per streamed choice.

`hermes` is Qwen3's format (and Hermes 2 Pro's): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, on lines of
its own, after any think block and text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from serving.core.structured_params import COMPACT_JSON
from serving.parsers.tags import partial_tag_len

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = dataclasses.field(default_factory=call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParsedReply:
    content: str | None  # the text before the first call (all of it without calls)
    calls: list[ToolCall]


def _arguments_text(body: str) -> str | None:
    """The raw text of the `arguments` value of a call body: an object matched by its
    braces (quotes and escapes respected), possibly still open. None before it starts."""
    match = _ARGUMENTS.search(body)
    if match is None or match.end() == len(body):
        return None
    raw = body[match.end():]
    if raw[0] != "{":
        return None
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(raw):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{}":
            depth += 1 if char == "{" else -1
            if depth == 0:
                return raw[:i + 1]
    return raw


def _parse_call(body: str, names: frozenset[str] | None) -> ToolCall | None:
    """A complete call body -> ToolCall, or None when it is not one (broken JSON, no
    name, arguments not an object, a function not among `names`)."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    if names is not None and call["name"] not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    raw = _arguments_text(body)  # the model's own text, so streamed pieces join to it
    text = raw if raw is not None and json.loads(raw) == arguments else json.dumps(arguments)
    return ToolCall(call["name"], text)


def _regions(text: str) -> tuple[str, list[str]]:
    """(text before the first call, each call's body). A last call without its end tag
    runs to the end of the text."""
    start = text.find(CALL_START)
    if start < 0:
        return text, []
    bodies, pos = [], start
    while pos >= 0:
        body_start = pos + len(CALL_START)
        end = text.find(CALL_END, body_start)
        bodies.append(text[body_start:end if end >= 0 else len(text)].strip())
        pos = text.find(CALL_START, end) if end >= 0 else -1
    return text[:start], bodies


class HermesToolParser:
    """Qwen3 / Hermes tool calls, whole (`extract`) or streamed (`feed`).

    A reply whose calls do not all parse, or that names a function not in `tools`, is
    returned whole as text (vLLM's behaviour). Streaming sends the text before the first
    call as content (holding back a possible `<tool_call>` prefix), then for each call its
    name once complete (and known), then its arguments in pieces as they arrive; the
    pieces join to the arguments `extract` returns. A call that breaks after its
    arguments began to stream cannot be taken back: `finish` then reports it.
    """

    def __init__(self, tool_names=None, max_calls: int | None = None):
        self.names = None if tool_names is None else frozenset(tool_names)
        self.max_calls = max_calls
        self._text = ""
        self._content_sent = 0  # chars of the text before the first call already sent
        self._calls: list[ToolCall] = []  # calls whose name has been sent
        self._args_sent: list[int] = []  # chars of each call's arguments sent

    @classmethod
    def extract(cls, text: str, tool_names=None, max_calls: int | None = None) -> ParsedReply:
        before, bodies = _regions(text)
        if not bodies:
            return ParsedReply(text, [])
        names = None if tool_names is None else frozenset(tool_names)
        parsed = [_parse_call(body, names) for body in bodies]
        calls = [call for call in parsed if call is not None]
        if len(calls) < len(parsed):  # one bad call: the text stays content, as vLLM's
            return ParsedReply(text, [])
        return ParsedReply(before or None, calls[:max_calls])

    @property
    def calls(self) -> list[ToolCall]:
        """The calls streamed so far (name sent)."""
        return self._calls

    def feed(self, delta: str, finished: bool = False) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas in OpenAI's streamed shape) for new text."""
        self._text += delta
        before, bodies = _regions(self._text)
        content = self._content(before, bool(bodies) or finished)
        deltas: list[dict] = []
        for index, body in enumerate(bodies[:self.max_calls]):
            if not self._advance(index, body, deltas):
                break
        return content, deltas

    def _content(self, before: str, complete: bool) -> str:
        end = len(before) if complete else len(before) - partial_tag_len(before, CALL_START)
        piece = before[self._content_sent:end] if end > self._content_sent else ""
        self._content_sent = max(self._content_sent, end)
        return piece

    def _advance(self, index: int, body: str, deltas: list[dict]) -> bool:
        """Adds call `index`'s new deltas; False when it cannot go on yet (so later calls
        wait for it)."""
        if index == len(self._calls):
            match = _NAME.search(body)
            if match is None or (self.names is not None and match.group(1) not in self.names):
                return False
            self._calls.append(ToolCall(json.loads(f'"{match.group(1)}"'), ""))
            self._args_sent.append(0)
            call = self._calls[index]
            deltas.append({"index": index, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
        raw = _arguments_text(body) or ""
        if len(raw) > self._args_sent[index]:
            piece = raw[self._args_sent[index]:]
            self._args_sent[index] = len(raw)
            self._calls[index].arguments += piece
            deltas.append({"index": index, "function": {"arguments": piece}})
        return True

    def finish(self) -> tuple[str, ParsedReply]:
        """(content still to send, the whole reply's parse) once the reply has ended.
        Without valid calls the reply is text, so whatever was held back is content; the
        parsed calls keep the ids that were streamed."""
        parsed = self.extract(self._text, self.names, self.max_calls)
        for call, sent in zip(parsed.calls, self._calls):
            call.id = sent.id
        rest = "" if parsed.calls else self._text[self._content_sent:]
        self._content_sent = len(self._text)
        return rest, parsed


def _tag(text: str, token_ids: dict) -> str:
    """A tag as a grammar atom: its token when the tokenizer has it as one (so the model
    writes it as it was trained to), else the literal text."""
    token = token_ids.get(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def calls_grammar(tools: list[dict], parallel: bool, token_ids: dict) -> str:
    """An llguidance Lark grammar for a reply made only of Hermes tool calls of `tools`
    (one, or one or more when `parallel`), each call's JSON following its function's
    parameters schema. token_ids: tag text -> token id (or None)."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}}
             for t in tools]
    schema = json.dumps({"anyOf": calls, "x-guidance": COMPACT_JSON})
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return (f"%llguidance {{}}\n{start}\ncall: {_tag(CALL_START, token_ids)} \"\\n\" "
            f"%json {schema} \"\\n\" {_tag(CALL_END, token_ids)}\n")


TOOL_PARSERS = {"hermes": HermesToolParser}


def tool_parser_class(name: str) -> type[HermesToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]
