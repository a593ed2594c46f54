"""The tiny model's tool task: call an `add` tool, then answer from the tool's result.

Two assistant turns per problem, rendered by the checkpoint's (Qwen3) chat template with
`tools`: for "Use the tool to add 385 and 47." the model writes an empty think block and a
Hermes-style call, `<tool_call>\\n{"name": "add", "arguments": {"a": 385, "b": 47}}\\n
</tool_call>`; given the tool's result in a `role: "tool"` turn it answers
`385 + 47 = 432`, copying the result (an empty think block leaves it no room to add).
`qwen_jax.tasks.make_tool` draws the problems; `serving.bench.eval_tasks` scores the loop
(it needs the server's tool-call parser, and the model never imports the engine).
"""

from __future__ import annotations

import dataclasses
import json

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = (ADD_TOOL,)
EMPTY_THINK = "<think>\n\n</think>\n\n"
MAX_TOOL_TOKENS = 64  # the call turn is about 30 tokens, the answer turn about 20


@dataclasses.dataclass(frozen=True)
class ToolProblem:
    """One tool problem: the user asks, the model calls `add`, the tool answers, the
    model answers. `result` is what the tool returns (the true sum)."""

    task: str
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"Use the tool to add {self.a} and {self.b}."

    @property
    def arguments(self) -> str:
        return json.dumps({"a": self.a, "b": self.b})

    @property
    def result(self) -> str:
        return str(self.a + self.b)

    @property
    def answer(self) -> str:
        return f"{self.a} + {self.b} = {self.result}"

    @property
    def call_text(self) -> str:
        """The tool call as the model writes it (Qwen3's Hermes format)."""
        return f'<tool_call>\n{{"name": "add", "arguments": {self.arguments}}}\n</tool_call>'

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    def answer_messages(self, result: str | None = None) -> list[dict]:
        """The conversation after the call: the assistant's call and the tool's result."""
        call = {"id": "call_0", "type": "function",
                "function": {"name": "add", "arguments": self.arguments}}
        return [*self.messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0",
                 "content": self.result if result is None else result}]

    def turns(self) -> list[tuple[list[dict], tuple, str]]:
        """(messages, tools, completion) for each assistant turn, as trained."""
        return [(self.messages, TOOLS, EMPTY_THINK + self.call_text),
                (self.answer_messages(), TOOLS, EMPTY_THINK + self.answer)]
