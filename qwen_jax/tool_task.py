"""The tiny model's tool task: call an `add` tool, then answer from the tool's result.

Two assistant turns per problem, rendered by the checkpoint's (Qwen3) chat template with
`tools`: for "Use the tool to add 385 and 47." the model writes an empty think block and a
Hermes-style call, `<tool_call>\\n{"name": "add", "arguments": {"a": 385, "b": 47}}\\n
</tool_call>`; given the tool's result in a `role: "tool"` turn it answers
`385 + 47 = 432`, copying the result (an empty think block leaves it no room to add).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

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


def make_tool(rng: np.random.Generator) -> ToolProblem:
    from qwen_jax.tasks import _number
    return ToolProblem("tool", _number(rng, 3), _number(rng, 3))


def parse_call(text: str) -> dict | None:
    """The arguments of the one `add` call of a generated first turn (after its think
    block, as the server's `--reasoning-parser qwen3` splits it), parsed as the server's
    Hermes tool parser parses it; None unless there is exactly one such call."""
    from serving.reasoning import Qwen3ReasoningParser
    from serving.tool_parsers import HermesToolParser
    content = Qwen3ReasoningParser.extract(text)[1] or ""
    parsed = HermesToolParser.extract(content, ["add"])
    if len(parsed.calls) != 1 or parsed.content:
        return None
    arguments = json.loads(parsed.calls[0].arguments)
    return arguments if set(arguments) == {"a", "b"} else None


def render(template: str, conversations: list[list[dict]]) -> list[str]:
    """Prompts with the tools, ending at `<|im_start|>assistant\n` (thinking mode)."""
    from qwen_jax.tokenizer import compile_chat_template, normalize_messages
    compiled = compile_chat_template(template)
    return [compiled.render(messages=normalize_messages(m), tools=list(TOOLS),
                            add_generation_prompt=True) for m in conversations]


def evaluate(problems: list[ToolProblem], template: str, generate) -> list[bool]:
    """Per problem, the whole loop: the model calls `add` with the right arguments, the
    call is run, and given its result the model answers exactly. `generate(prompts,
    max_tokens) -> texts`."""
    from qwen_jax.tasks import final_answer
    calls = [parse_call(t) for t in generate(render(template, [p.messages for p in problems]),
                                             MAX_TOOL_TOKENS)]
    right = [c == {"a": p.a, "b": p.b} for c, p in zip(calls, problems)]
    follow = [p for p, ok in zip(problems, right) if ok]
    answers = generate(render(template, [p.answer_messages() for p in follow]), MAX_TOOL_TOKENS)
    exact = iter(final_answer(text) == p.answer for text, p in zip(answers, follow))
    return [ok and next(exact) for ok in right]
