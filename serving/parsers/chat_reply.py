"""A chat reply's text -> OpenAI's `message` / streamed `delta`: the reasoning parser splits
off the think block, then the tool parser pulls tool calls out of the content."""

from __future__ import annotations

import dataclasses

from serving.parsers.reasoning import Qwen3ReasoningParser
from serving.parsers.tool_parsers import HermesToolParser


@dataclasses.dataclass(frozen=True)
class ReplyFormat:
    """How one request's replies are split. `tool_parser`: None leaves tool-call text in
    the content; `tools_finish`: the finish_reason of a reply with calls ("tool_calls", or
    "stop" for a named tool_choice, as vLLM and OpenAI answer)."""

    reasoning_parser: type[Qwen3ReasoningParser] | None = None
    include_reasoning: bool = True
    tool_parser: type[HermesToolParser] | None = None
    tool_names: tuple[str, ...] | None = None
    max_calls: int | None = None  # 1 without parallel_tool_calls
    tools_finish: str = "tool_calls"

    def _reasoning_fields(self, reasoning: str | None) -> dict:
        if self.reasoning_parser is None or not self.include_reasoning:
            return {}
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(message, finish_reason) of a whole reply."""
        reasoning, content = ((None, text) if self.reasoning_parser is None
                              else self.reasoning_parser.extract(text))
        message = {"role": "assistant", "content": content, **self._reasoning_fields(reasoning)}
        if self.tool_parser is None or content is None:
            return message, finish_reason
        parsed = self.tool_parser.extract(content, self.tool_names, self.max_calls)
        if not parsed.calls:
            return message, finish_reason
        message["content"] = parsed.content
        message["tool_calls"] = [call.to_openai() for call in parsed.calls]
        return message, self.tools_finish if finish_reason is not None else None

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


class ReplyStream:
    """One streamed choice: text deltas in, `delta` objects out."""

    def __init__(self, fmt: ReplyFormat):
        self.fmt = fmt
        self.reasoning = fmt.reasoning_parser() if fmt.reasoning_parser else None
        self.tools = (fmt.tool_parser(fmt.tool_names, fmt.max_calls) if fmt.tool_parser
                      else None)
        self.called = False

    def delta(self, text: str, finished: bool) -> dict:
        """The delta for new text (without the first chunk's role)."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(
            text, finished)
        delta = {}
        if reasoning:
            delta.update(self.fmt._reasoning_fields(reasoning))
        calls: list[dict] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, finished)
            if finished:
                rest, parsed = self.tools.finish()
                content, self.called = content + rest, bool(parsed.calls)
        if calls:
            delta["tool_calls"] = calls
        if content or not (reasoning or calls):  # a chunk that holds text back: content ""
            delta["content"] = content
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return self.fmt.tools_finish if reason is not None and self.called else reason
