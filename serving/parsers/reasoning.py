"""Reasoning parsers (vLLM's `--reasoning-parser`): split a thinking model's output into
`reasoning_content` (inside `<think>...</think>`) and `content` (after it).

Host-side text only: no jax, no tokenizer. One parser object per streamed choice.
"""

from __future__ import annotations

from serving.parsers.tags import partial_tag_len

THINK_START, THINK_END = "<think>", "</think>"


class Qwen3ReasoningParser:
    """Qwen3 thinking output: `<think>\\nREASONING\\n</think>\\n\\nCONTENT`.

    Output that does not start with `<think>` is all content (an enable_thinking=False
    prompt already holds the empty think block). Output that starts with `<think>` but
    has no `</think>` was cut off mid-thought: all reasoning, no content. Newlines around
    the reasoning and before the content are dropped, in both modes alike.

    Streaming decides at the first characters: a `</think>` in output that did not start
    with `<think>` stays content there, whereas `extract` still splits at it.
    """

    def __init__(self) -> None:
        self._state = "start"  # "start" -> "reasoning" -> "content", or "start" -> "content"
        self._pending = ""  # text held back: a possible tag prefix or trailing newlines
        self._started = False  # whether the current part has emitted a character yet

    @staticmethod
    def extract(text: str) -> tuple[str | None, str | None]:
        """(reasoning_content or None, content); content is None when the output was all
        reasoning."""
        if THINK_END in text:
            reasoning, _, content = text.partition(THINK_END)
            reasoning = reasoning.removeprefix(THINK_START).strip("\n")
            return reasoning or None, content.lstrip("\n") or None
        if text.startswith(THINK_START):
            return text[len(THINK_START):].strip("\n") or None, None
        return None, text

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of text; `finished` flushes
        what was held back."""
        self._pending += delta
        reasoning = content = ""
        if self._state == "start":
            self._decide_start(finished)
        if self._state == "reasoning":
            reasoning = self._reasoning(finished)
        if self._state == "content":
            content = self._content()
        return reasoning, content

    def _decide_start(self, finished: bool) -> None:
        if self._pending.startswith(THINK_START):
            self._state, self._pending = "reasoning", self._pending[len(THINK_START):]
        elif finished or not THINK_START.startswith(self._pending):
            self._state, self._started = "content", True

    def _reasoning(self, finished: bool) -> str:
        text, tag, after = self._pending.partition(THINK_END)
        if tag:
            self._state, self._pending = "content", after
            emit = text.rstrip("\n")
        elif finished:
            self._pending, emit = "", text.rstrip("\n")
        else:  # hold back a possible `</think>` prefix and the newlines before it
            cut = len(text) - partial_tag_len(text, THINK_END)
            while cut and text[cut - 1] == "\n":
                cut -= 1
            emit, self._pending = text[:cut], text[cut:]
        emit = self._lstrip_first(emit)
        if tag:
            self._started = False  # the content part starts fresh
        return emit

    def _content(self) -> str:
        emit, self._pending = self._lstrip_first(self._pending), ""
        return emit

    def _lstrip_first(self, text: str) -> str:
        if not self._started:
            text = text.lstrip("\n")
            self._started = bool(text)
        return text


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}


def reasoning_parser_class(name: str) -> type[Qwen3ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                         f"got {name!r}")
    return REASONING_PARSERS[name]
